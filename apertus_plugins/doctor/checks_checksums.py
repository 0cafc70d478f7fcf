"""``checksums`` (``--checksums MANIFEST``): the checkpoint's tokenizer and template files against a manifest.

The tokenizer repository (``swiss-ai/apertus-omni-tokenizer``) publishes, under ``validation/``, one
manifest per released tokenizer (``Apertus_1p5.md5``): ``md5sum``'s own format, one line per file a
served model directory must hold (flat), ``<32 hex digits><two spaces><file name>`` (``md5sum -c``
reads it; a ``*`` in place of the second space marks binary mode). The manifest is read from a path
the user gives (a checkout of that repository, or a copy of the file): nothing is fetched.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path, PurePosixPath

from .checkpoint_files import DoctorError
from .registry import Context, Outcome, check
from .report import FAIL, PASS

__all__ = ["load_checksum_manifest", "md5_of"]

_LINE = re.compile(r"^([0-9a-fA-F]{32}) [ *](\S.*)$")
#: Bytes read at a time when hashing (tokenizer.json is tens of megabytes).
_CHUNK = 1 << 20


def load_checksum_manifest(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """``[(file name, md5 hex), ...]`` of a manifest in ``md5sum`` format; a bad manifest is a :class:`DoctorError`.

    Names must be relative paths inside the checkpoint (no ``..``, not absolute); blank lines are
    skipped; a file named twice, a line that is not ``<md5>  <name>`` or an empty manifest is an error
    naming the manifest and the line.
    """
    p = Path(path)
    if not p.is_file():
        raise DoctorError(f"{p}: no such checksum manifest")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DoctorError(f"{p}: not a readable text manifest ({exc})") from exc
    entries: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise DoctorError(f"{p}: line {number} is not '<md5>  <file name>' (md5sum's format): {line[:80]!r}")
        digest, name = m.group(1).lower(), m.group(2).rstrip()
        parts = PurePosixPath(name).parts
        if name.startswith(("/", "\\")) or ".." in parts or "\\" in name or not parts:
            raise DoctorError(f"{p}: line {number} names {name!r}, not a file inside the checkpoint directory")
        if name in entries:
            raise DoctorError(f"{p}: line {number} names {name!r} a second time")
        entries[name] = digest
    if not entries:
        raise DoctorError(f"{p}: an empty checksum manifest (no '<md5>  <file name>' line)")
    return list(entries.items())


def md5_of(path: str | os.PathLike[str]) -> str:
    """The md5 hex digest of a file's bytes (a checksum, not a security measure)."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


@check("checksums.files", "the tokenizer and template files are byte-identical to the checksum manifest")
def files(ctx: Context) -> Outcome:
    if not ctx.checksums:
        raise DoctorError("no checksum manifest given (--checksums MANIFEST)")
    root = ctx.ckpt.path
    differ, missing, match = [], [], []
    for name, expected in ctx.checksums:
        f = root / name
        if not f.is_file():
            missing.append(name)
            continue
        got = md5_of(f)
        if got == expected:
            match.append(name)
        else:
            differ.append({"file": name, "md5": got, "expected": expected})
    source = ctx.checksums_name or "the manifest"
    details = {"manifest": ctx.checksums_name, "match": match, "differ": differ, "missing": missing}
    if differ or missing:
        said = [f"{d['file']} differs (md5 {d['md5']}, {source} has {d['expected']})" for d in differ]
        said += [f"{name} is missing" for name in missing]
        return FAIL, f"{'; '.join(said)}; {len(match)} of {len(ctx.checksums)} files match", details
    return PASS, f"{len(match)} files match {source}: {', '.join(match)}", details
