"""The package's one rule for small files: JSON read with a named error, text written whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from apertus_plugins.infra.files import read_json, write_text_atomic


class Refused(ValueError):
    pass


def test_a_bad_json_file_is_the_callers_error_naming_it(tmp_path: Path) -> None:
    good, bad, binary = tmp_path / "good.json", tmp_path / "bad.json", tmp_path / "binary.json"
    good.write_text('{"a": [1, 2]}', encoding="utf-8")
    bad.write_text('{"a": ', encoding="utf-8")
    binary.write_bytes(b"\xff\xfe{}")
    assert read_json(good) == {"a": [1, 2]}
    with pytest.raises(Refused, match=r"bad\.json: not valid JSON"):
        read_json(bad, Refused)
    with pytest.raises(Refused, match=r"binary\.json: not valid JSON"):
        read_json(binary, Refused)


def test_text_is_written_whole_or_the_old_file_stays(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "out.txt"
    assert write_text_atomic(path, "first\n") == path
    assert path.read_text(encoding="utf-8") == "first\n"
    write_text_atomic(path, "second\n")
    assert path.read_text(encoding="utf-8") == "second\n"
    with pytest.raises(UnicodeEncodeError):  # fails while writing: a lone surrogate cannot be UTF-8
        write_text_atomic(path, "x" * 100_000 + "\ud800")
    assert path.read_text(encoding="utf-8") == "second\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]  # no temporary file left behind
