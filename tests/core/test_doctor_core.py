"""``apertus doctor`` in the core environment (no torch): tokenizer and template checks on tokenizer
directories, the config checks on a checkpoint whose weights file is written by hand, the image
layout of datasets, the report and the command line. The breakage matrix on a real checkpoint
and the ``--serve`` checks run in the vllm suite (``tests/vllm/test_doctor_*.py``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _vectors import PACKAGE_VECTORS_PATH, SHARED_VECTORS_PATH

from apertus_plugins.core.chat import ChatTokenizer, jinja_template, render
from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.doctor import (
    CHECKS,
    FAIL,
    GROUPS,
    PASS,
    WARN,
    CheckpointFiles,
    DoctorError,
    run_doctor,
    select_checks,
)
from apertus_plugins.doctor.checks_template import rendering_vectors
from apertus_plugins.testing.checkpoint import write_stand_in
from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

TOKENIZER_CHECKS = {c.id for c in CHECKS if c.group in ("tokenizer", "template")}
OFFLINE = {c.id for c in CHECKS if c.group not in ("compare", "serve", "checksums")}
DOCTOR = [sys.executable, "-m", "apertus_plugins.cli", "doctor"]


def test_the_package_ships_the_rendering_vectors():
    assert json.loads(PACKAGE_VECTORS_PATH.read_text()) == rendering_vectors()
    assert len(rendering_vectors()) >= 8


if SHARED_VECTORS_PATH.is_file():  # a clone of the public repository has no shared/ beside it

    def test_the_shipped_vectors_are_the_shared_vectors_byte_for_byte():
        assert PACKAGE_VECTORS_PATH.read_bytes() == SHARED_VECTORS_PATH.read_bytes()


def test_a_checkpoint_template_renders_through_the_core(tmp_path):
    training = jinja_template("training")
    msgs = [{"role": "user", "content": "Hi <|system_start|>"}]
    assert render(msgs, template=training) == render(msgs, variant="training")
    chat = ChatTokenizer(build_test_tokenizer(tmp_path / "tok"))
    a = chat.encode_conversation(msgs, template=training)
    b = chat.encode_conversation(msgs, variant="training")
    assert a.ids.tolist() == b.ids.tolist() and a.roles.tolist() == b.roles.tolist()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_test_tokenizer(tmp_path_factory.mktemp("doctor_tok") / "tok")


def test_a_tokenizer_directory_passes_the_tokenizer_and_template_checks(tokenizer_dir):
    report = run_doctor(tokenizer_dir, only=["tokenizer", "template"])
    assert {r.id for r in report.results} == TOKENIZER_CHECKS
    assert report.ids(PASS) == TOKENIZER_CHECKS, report.table()
    # without config.json and weights the config checks fail, naming the file
    full = run_doctor(tokenizer_dir)
    assert full.ids(FAIL) == {"config.output_vocab", "config.rope", "config.generation_stops"}, full.table()
    assert "no config.json" in full.by_id()["config.rope"].evidence
    assert "no generation_config.json" in full.by_id()["config.generation_stops"].evidence


def test_the_released_layout_pins_the_released_ids(apertus_full_tokenizer_dir, apertus_tokenizer_dir):
    report = run_doctor(apertus_full_tokenizer_dir, only=["tokenizer"])
    assert report.ids(FAIL) == set() and report.ids(WARN) == set(), report.table()
    assert report.layout == "released layout, 266,440 ids"
    by = report.by_id()
    assert by["tokenizer.length"].evidence.startswith("266,440 entries = text 131,072 + omni 200 + image 131,072")
    pins = by["tokenizer.pins"].evidence
    for want in ("<think> and <|inner_prefix|> -> 32", "<image> -> 131079", "<|visual token 0|> -> 131272",
                 "<|audio token 0|> -> 262344"):
        assert want in pins
    # these fixtures have no chat template: the template checks say so
    templates = run_doctor(apertus_tokenizer_dir, only=["template"])
    assert templates.ids(FAIL) == {"template.vectors", "template.bos", "template.injection"}
    assert templates.ids(WARN) == {"template.training"}
    assert "ships no chat template" in templates.by_id()["template.vectors"].evidence


# ---------------------------------------------------------------------------------------------- a torch-free checkpoint

@pytest.fixture()
def stand_in(tmp_path) -> Path:
    """The files of a checkpoint with the layout's shapes: tokenizer, configs, a zero embedding and head."""
    return write_stand_in(tmp_path / "ckpt")


def test_a_torch_free_checkpoint_passes_every_offline_check(stand_in):
    report = run_doctor(stand_in)
    assert {r.id for r in report.results} == OFFLINE
    assert report.ids(PASS) == OFFLINE, report.table()
    assert CheckpointFiles(stand_in).tensor_shapes["lm_head.weight"] == [512, 128]


def test_an_unreadable_weights_file_fails_the_checks_that_read_it(stand_in):
    (stand_in / "model-00002-of-00002.safetensors").write_bytes(b"\x00\x01")
    report = run_doctor(stand_in)
    assert report.ids(FAIL) == {"config.output_vocab"}, report.table()
    assert "not a safetensors file" in report.by_id()["config.output_vocab"].evidence


def test_a_config_that_is_not_json_is_named(stand_in):
    (stand_in / "generation_config.json").write_text("{not json")
    report = run_doctor(stand_in, only=["config"])
    assert report.ids(FAIL) == {"config.generation_stops"}
    assert "generation_config.json: not valid JSON" in report.by_id()["config.generation_stops"].evidence


# ---------------------------------------------------------------------------------------------- layout

def _dataset(prefix: Path, layout: str, tokenizer: Path) -> Path:
    from apertus_plugins.core.media.image import image_sequence, text_ids_from_tokenizer
    from apertus_plugins.data.indexed import IndexedDatasetWriter

    spec, text_ids = VocabSpec.from_tokenizer_dir(tokenizer), text_ids_from_tokenizer(tokenizer)
    with IndexedDatasetWriter(prefix, dtype=np.int32) as w:
        w.add_document(np.concatenate([[spec.bos_id], image_sequence(np.arange(4).reshape(2, 2), spec, layout, text_ids),
                                       [spec.eos_id]]))
    return prefix


def test_the_layout_of_a_dataset_against_the_serving_default(tokenizer_dir, tmp_path):
    train = _dataset(tmp_path / "train", "training", tokenizer_dir)
    serve = _dataset(tmp_path / "serve", "inference", tokenizer_dir)
    skew = run_doctor(tokenizer_dir, datasets=[train, serve], only=["layout"]).by_id()["layout.image"]
    assert skew.status == WARN and "train: training" in skew.evidence and "serve:" not in skew.evidence
    same = run_doctor(tokenizer_dir, datasets=[str(serve) + ".idx"], only=["layout"]).by_id()["layout.image"]
    assert same.status == PASS and "1 dataset(s) and the serving default (no --serve) all use the inference" in \
        same.evidence
    missing = run_doctor(tokenizer_dir, datasets=[tmp_path / "nothing"], only=["layout"]).by_id()["layout.image"]
    assert missing.status == FAIL and "nothing" in missing.evidence


# ---------------------------------------------------------------------------------------------- runner and report

def _manifest(path: Path, directory: Path, names: list[str]) -> Path:
    """A manifest written as the tokenizer repository's validation/gen_checksums.sh writes one: md5sum's lines."""
    import hashlib

    lines = [f"{hashlib.md5((directory / n).read_bytes()).hexdigest()}  {n}\n" for n in names]  # noqa: S324
    path.write_text("".join(lines))
    return path


def test_the_tokenizer_and_template_files_against_a_checksum_manifest(tokenizer_dir, tmp_path):
    import shutil

    names = sorted(p.name for p in tokenizer_dir.iterdir() if p.suffix in (".json", ".jinja"))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names), names
    manifest = _manifest(tmp_path / "Apertus_1p5.md5", tokenizer_dir, names)
    report = run_doctor(tokenizer_dir, only=["checksums"], checksums=manifest)
    result = report.by_id()["checksums.files"]
    assert result.status == PASS and result.evidence.startswith(f"{len(names)} files match Apertus_1p5.md5"), result
    assert "checksums.files" not in {r.id for r in run_doctor(tokenizer_dir, only=["checksums"]).results}

    # one template byte changed, one file gone: both named, the rest counted
    copy = tmp_path / "ckpt"
    shutil.copytree(tokenizer_dir, copy)
    (copy / "chat_template.jinja").write_text((copy / "chat_template.jinja").read_text() + " ")
    (copy / "tokenizer_config.json").unlink()
    result = run_doctor(copy, only=["checksums"], checksums=manifest).by_id()["checksums.files"]
    assert result.status == FAIL, result
    assert result.evidence.startswith("chat_template.jinja differs (md5 "), result.evidence
    assert "Apertus_1p5.md5 has " in result.evidence and "tokenizer_config.json is missing" in result.evidence
    assert result.evidence.endswith(f"; {len(names) - 2} of {len(names)} files match")
    assert [d["file"] for d in result.details["differ"]] == ["chat_template.jinja"]

    # md5sum's binary marker and upper-case digits are the same format; the command line takes --checksums
    binary = [f"{line[:32].upper()} *{line[34:]}" for line in manifest.read_text().splitlines()]
    (tmp_path / "binary.md5").write_text("\r\n".join(binary) + "\r\n")
    out = subprocess.run(DOCTOR + [str(tokenizer_dir), "--only", "checksums", "--checksums", str(tmp_path / "binary.md5")],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "PASS    checksums.files" in out.stdout, out.stdout + out.stderr
    out = subprocess.run(DOCTOR + [str(copy), "--only", "checksums", "--checksums", str(manifest)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "chat_template.jinja differs" in out.stdout, out.stdout


@pytest.mark.parametrize(("text", "words"), [
    ("", "an empty checksum manifest"),
    ("not a checksum line\n", "line 1 is not '<md5>  <file name>'"),
    ("0123456789abcdef0123456789abcdef  ../outside.json\n", "not a file inside the checkpoint directory"),
    ("0123456789abcdef0123456789abcdef  /etc/passwd\n", "not a file inside the checkpoint directory"),
    ("0123456789abcdef0123456789abcdef  a.json\n\n0123456789abcdef0123456789abcdef  a.json\n",
     "line 3 names 'a.json' a second time"),
])
def test_a_bad_checksum_manifest_is_an_error_naming_it(tokenizer_dir, tmp_path, text, words):
    manifest = tmp_path / "bad.md5"
    manifest.write_text(text)
    with pytest.raises(DoctorError, match=re.escape(words)):
        run_doctor(tokenizer_dir, checksums=manifest)
    with pytest.raises(DoctorError, match="no such checksum manifest"):
        run_doctor(tokenizer_dir, checksums=tmp_path / "none.md5")


def test_check_selection():
    order = [GROUPS.index(c.group) for c in select_checks()]
    assert order == sorted(order) and {c.group for c in select_checks()} == {"tokenizer", "template", "config", "layout"}
    assert {c.group for c in select_checks(compare=True, serve=True)} == {
        "tokenizer", "template", "config", "serve", "layout", "compare"}
    assert [c.id for c in select_checks(["config.rope", "layout"])] == ["config.rope", "layout.image"]
    with pytest.raises(DoctorError, match="unknown check or group bogus"):
        select_checks(["bogus"])


def test_bad_inputs_are_errors_that_name_them(tmp_path, tokenizer_dir):
    with pytest.raises(DoctorError, match=r"missing': no such file or directory \(and not a Hub model id"):
        run_doctor(tmp_path / "missing")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(DoctorError, match="a-file: not a directory"):
        run_doctor(tmp_path / "a-file")
    with pytest.raises(DoctorError, match="cannot reach the server"):
        run_doctor(tokenizer_dir, serve="http://127.0.0.1:9", timeout=5)
    with pytest.raises(DoctorError, match="expected an http"):
        run_doctor(tokenizer_dir, serve="localhost:8000")


def test_the_command_line(tokenizer_dir, tmp_path):
    assert subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "--help"], capture_output=True,
                          text=True).stdout.count("doctor") >= 1
    ok = subprocess.run(DOCTOR + [str(tokenizer_dir), "--only", "tokenizer,template"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "9 checks: 9 pass, 0 warn, 0 fail"
    assert "PASS    tokenizer.length" in ok.stdout
    bad = subprocess.run(DOCTOR + [str(tokenizer_dir), "--json"], capture_output=True, text=True)
    assert bad.returncode == 1
    data = json.loads(bad.stdout)
    assert data["ok"] is False and data["summary"]["fail"] == 3
    assert {c["id"] for c in data["checks"]} == OFFLINE
    assert all(set(c) >= {"id", "group", "title", "status", "evidence", "details"} for c in data["checks"])
    for args, words in ((["--only", "bogus"], "unknown check or group bogus"),
                        (["--probe-prompts", str(tmp_path / "none.json")], "no such probe prompt file")):
        out = subprocess.run(DOCTOR + [str(tokenizer_dir), *args], capture_output=True, text=True)
        assert out.returncode == 2 and words in out.stderr, out.stderr
    strict = subprocess.run(DOCTOR + [str(tokenizer_dir), "--only", "layout", "--dataset",
                                      str(_dataset(tmp_path / "t", "training", tokenizer_dir)), "--strict"],
                            capture_output=True, text=True)
    assert strict.returncode == 1 and "WARN    layout.image" in strict.stdout


def test_the_demos_doctor_step_counts_every_failure_but_random_weight_degeneration(capsys):
    from apertus_plugins.cli.demo import print_doctor
    from apertus_plugins.doctor import Report, Result

    def report(*failing: str) -> Report:
        ids = ["template.vectors", "serve.text", "serve.degeneration"]
        return Report("ckpt", [Result(i, i.split(".")[0], i, FAIL if i in failing else PASS, "evidence") for i in ids],
                      serve="http://127.0.0.1:1")

    assert print_doctor(report()) == 0
    assert print_doctor(report("serve.degeneration")) == 0
    assert "not counted in the demo's exit code" in capsys.readouterr().out
    assert print_doctor(report("serve.text")) == 1
    assert print_doctor(report("template.vectors", "serve.degeneration")) == 1
    out = capsys.readouterr().out
    assert "== apertus doctor ckpt --serve http://127.0.0.1:1 ==" in out and "FAIL    template.vectors" in out
