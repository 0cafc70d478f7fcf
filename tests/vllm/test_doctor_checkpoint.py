"""``apertus doctor`` on a small checkpoint in the released layout, and on copies broken one way each.

The checkpoint comes from the project's writer (``apertus_plugins.testing.checkpoint.write_checkpoint``):
random weights, the test tokenizer with the 1.5 id layout, the chat templates, the generation
config. Every breakage edits one file of a copy the way a real conversion or a careless stage
would; the doctor must fail exactly the check about it (warn, for the layout skew) and pass
every other one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from apertus_plugins.core.vocab import VocabSpec
from apertus_plugins.doctor import CHECKS, FAIL, PASS, WARN, run_doctor

OFFLINE = {c.id for c in CHECKS if c.group not in ("compare", "serve", "checksums")}


@pytest.fixture(scope="session")
def good(tmp_path_factory) -> Path:
    from apertus_plugins.testing.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("doctor") / "good", seed=3)


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def edit_text(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


# ---------------------------------------------------------------------------------------------- breakages

def extra_token(d: Path) -> None:
    def add(tok):
        top = max(t["id"] for t in tok["added_tokens"])
        tok["added_tokens"].append({"id": top + 1, "content": "<|stray|>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    edit_json(d / "tokenizer.json", add)


def think_not_aliased(d: Path) -> None:
    def drop(tok):
        steps = tok["normalizer"]["normalizers"]
        tok["normalizer"]["normalizers"] = [s for s in steps if (s.get("pattern") or {}).get("String") != "<think>"]
        assert len(tok["normalizer"]["normalizers"]) == len(steps) - 1
    edit_json(d / "tokenizer.json", drop)


def delimiters_special(d: Path) -> None:
    def mark(tok):
        for t in tok["added_tokens"]:
            if t["id"] in (32, 33):
                t["special"] = True
    edit_json(d / "tokenizer.json", mark)


def eos_is_assistant_end(d: Path) -> None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        edit_json(d / name, lambda c: c.__setitem__("eos_token", "<|assistant_end|>"))


def omnimodal_offset_off(d: Path) -> None:
    def shift(cfg):
        cfg["omnimodal_config"]["modalities"][0]["offset"] += 1
    edit_json(d / "tokenizer_config.json", shift)


def config_offset_off(d: Path) -> None:
    edit_json(d / "config.json", lambda c: c.__setitem__("audio_token_offset", c["audio_token_offset"] + 1))


def template_changed(d: Path) -> None:
    edit_text(d / "chat_template.jinja", "Deliberation: ", "Reasoning: ")


def double_bos(d: Path) -> None:
    """A conversion that dropped the tokenizer's bos_token and wrote the BOS into the templates as a literal:
    every render is unchanged, but a processor re-tokenizing the templated prompt adds a second BOS."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        edit_json(d / name, lambda c: c.pop("bos_token"))
    for name in ("chat_template.jinja", "additional_chat_templates/training.jinja"):
        edit_text(d / name, "{{- bos_token -}}", "<s>")


def training_with_default_system(d: Path) -> None:
    shutil.copy(d / "chat_template.jinja", d / "additional_chat_templates" / "training.jinja")


def injection_unsafe_template(d: Path) -> None:
    """Late system messages render as system blocks of their own (every vector still renders the same)."""
    edit_text(d / "chat_template.jinja", '{%- elif m.role == "tool" -%}',
              '{%- elif m.role == "system" -%}<|system_start|>{{ m.content }}<|system_end|>\n'
              '{%- elif m.role == "tool" -%}')


def head_rows_mismatch(d: Path) -> None:
    edit_json(d / "config.json", lambda c: c["text_config"].__setitem__("output_vocab_size", 1032))


def rope_dropped(d: Path) -> None:
    edit_json(d / "config.json", lambda c: c["text_config"].pop("rope_parameters"))


def no_tool_stop(d: Path) -> None:
    edit_json(d / "generation_config.json", lambda g: g.__setitem__("eos_token_id", [2, 68]))


def no_generation_config(d: Path) -> None:
    (d / "generation_config.json").unlink()


BREAKAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "tokenizer length": (extra_token, "tokenizer.length"),
    "<think> not aliased": (think_not_aliased, "tokenizer.pins"),
    "delimiters special": (delimiters_special, "tokenizer.thinking_delimiters"),
    "EOS <|assistant_end|>": (eos_is_assistant_end, "tokenizer.eos"),
    "omnimodal_config offset": (omnimodal_offset_off, "tokenizer.omnimodal_config"),
    "config offset": (config_offset_off, "tokenizer.omnimodal_config"),
    "changed chat template": (template_changed, "template.vectors"),
    "double BOS": (double_bos, "template.bos"),
    "training default system": (training_with_default_system, "template.training"),
    "injection-unsafe template": (injection_unsafe_template, "template.injection"),
    "output_vocab_size != head": (head_rows_mismatch, "config.output_vocab"),
    "RoPE scaling dropped": (rope_dropped, "config.rope"),
    "no tool stop": (no_tool_stop, "config.generation_stops"),
    "no generation config": (no_generation_config, "config.generation_stops"),
}


def broken_copy(good: Path, tmp_path: Path, breakage: Callable[[Path], None]) -> Path:
    d = tmp_path / "broken"
    shutil.copytree(good, d)
    breakage(d)
    return d


# ---------------------------------------------------------------------------------------------- tests

def test_the_correct_checkpoint_passes_every_check(good):
    report = run_doctor(good)
    assert {r.id for r in report.results} == OFFLINE
    assert report.ids(FAIL) == set() and report.ids(WARN) == set(), report.table()
    assert report.ok() and report.exit_code(strict=True) == 0
    assert "scaled test layout" in report.layout


def test_every_breakage_has_a_check():
    assert {check for _, check in BREAKAGES.values()} == OFFLINE - {"layout.image"}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_each_breakage_fails_its_own_check_and_only_it(good, tmp_path, name):
    breakage, check = BREAKAGES[name]
    report = run_doctor(broken_copy(good, tmp_path, breakage))
    assert report.ids(FAIL) == {check}, report.table()
    assert report.ids(WARN) == set(), report.table()
    assert report.exit_code() == 1
    evidence = report.by_id()[check].evidence
    assert evidence and "\n" not in evidence


def test_evidence_names_the_breakage(good, tmp_path):
    def evidence(breakage, check):
        return run_doctor(broken_copy(good, tmp_path / breakage.__name__, breakage)).by_id()[check].evidence

    assert "1,033 entries" in evidence(extra_token, "tokenizer.length")
    assert "<think> -> " in evidence(think_not_aliased, "tokenizer.pins")
    assert "is special in tokenizer.json" in evidence(delimiters_special, "tokenizer.thinking_delimiters")
    assert "'<|assistant_end|>'" in evidence(eos_is_assistant_end, "tokenizer.eos")
    assert "audio_token_offset 969" in evidence(config_offset_off, "tokenizer.omnimodal_config")
    assert "Reasoning" in evidence(template_changed, "template.vectors")
    assert "2 BOS" in evidence(double_bos, "template.bos")
    assert "Apertus 1.5 Omni" in evidence(training_with_default_system, "template.training")
    assert "second <|system_start|>" in evidence(injection_unsafe_template, "template.injection")
    assert "1,032" in evidence(head_rows_mismatch, "config.output_vocab")
    assert "no RoPE scaling" in evidence(rope_dropped, "config.rope")
    assert "lacks <|tools_suffix|> (72)" in evidence(no_tool_stop, "config.generation_stops")


def test_a_sharded_bf16_checkpoint_passes(tmp_path):
    from apertus_plugins.testing.checkpoint import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "sharded", dtype="bfloat16", shard_size="1MB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    report = run_doctor(ckpt)
    assert report.ids(FAIL) == set() and report.ids(WARN) == set(), report.table()


# ---------------------------------------------------------------------------------------------- layout

def _dataset(prefix: Path, layout: str, tokenizer: Path) -> Path:
    """An indexed dataset with image documents in ``layout`` (and one without images)."""
    from apertus_plugins.core.media.image import image_placeholder_sequence, image_sequence, text_ids_from_tokenizer
    from apertus_plugins.data.indexed import IndexedDatasetWriter

    spec, text_ids = VocabSpec.from_tokenizer_dir(tokenizer), text_ids_from_tokenizer(tokenizer)
    doc = np.concatenate([[spec.bos_id], image_sequence(np.arange(6).reshape(2, 3), spec, layout, text_ids),
                          image_placeholder_sequence(1, 2, spec, layout, text_ids), [spec.eos_id]])
    with IndexedDatasetWriter(prefix, dtype=np.int32) as w:
        w.add_document(np.array([spec.bos_id, 300, 301, spec.eos_id]))
        w.add_document(doc)
    return prefix


def _manifest(prefixes: list[Path], out: Path, layouts: dict[Path, str] | None = None) -> Path:
    """A manifest of ``prefixes``; ``layouts`` records each one's image layout in its metadata, as the
    offline pipeline does."""
    from apertus_plugins.data.manifest import write_manifest

    write_manifest(prefixes, out)
    if layouts:
        data = json.loads(out.read_text())
        for entry in data["datasets"]:
            entry["metadata"] = {"image_layout": layouts[Path(entry["prefix"])]}
        out.write_text(json.dumps(data, indent=2))
    return out


def test_layout_skew_between_training_data_and_serving_is_a_warning(good, tmp_path):
    train = _dataset(tmp_path / "sft", "training", good)
    report = run_doctor(good, datasets=[train])
    assert report.ids(WARN) == {"layout.image"} and report.ids(FAIL) == set(), report.table()
    result = report.by_id()["layout.image"]
    assert "training (read from its documents)" in result.evidence and result.details["serving"] == "inference"
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 1


def test_layout_from_manifests(good, tmp_path):
    a, b = _dataset(tmp_path / "a", "inference", good), _dataset(tmp_path / "b", "inference", good)
    # read from the documents, or from the metadata the offline pipeline records
    read = _manifest([a, b], tmp_path / "read.json")
    assert run_doctor(good, datasets=[read], only=["layout"]).ids(PASS) == {"layout.image"}
    recorded = _manifest([a, b], tmp_path / "recorded.json", {a: "inference", b: "training"})
    report = run_doctor(good, datasets=[recorded], only=["layout"])
    assert report.ids(WARN) == {"layout.image"}
    assert "b: training (recorded.json metadata)" in report.by_id()["layout.image"].evidence
    assert [r["layout"] for r in report.by_id()["layout.image"].details["datasets"]] == ["inference", "training"]


# ---------------------------------------------------------------------------------------------- across stages

COMPARE = {"compare.tokenizer", "compare.template", "compare.rope"}


def test_an_identical_stage_compares_clean(good, tmp_path):
    other = tmp_path / "stage2"
    shutil.copytree(good, other)
    report = run_doctor(good, compare=other)
    assert {r.id for r in report.results} == OFFLINE | COMPARE
    assert report.ids(FAIL) == set() and report.ids(WARN) == set(), report.table()


@pytest.mark.parametrize("breakage,check,words", [
    (delimiters_special, "compare.tokenizer", ["tokenizer.json", "added token 32", "special False vs True"]),
    (eos_is_assistant_end, "compare.tokenizer", ["tokenizer_config.json", "eos_token '</s>' vs '<|assistant_end|>'"]),
    (template_changed, "compare.template", ["default", "Deliberation", "Reasoning"]),
    (training_with_default_system, "compare.template", ["training"]),
    (rope_dropped, "compare.rope", ["missing in the other"]),
])
def test_a_stage_that_differs_lists_the_differences(good, tmp_path, breakage, check, words):
    other = broken_copy(good, tmp_path, breakage)
    report = run_doctor(good, compare=other, only=["compare"])
    assert report.ids(FAIL) == {check}, report.table()
    evidence = report.by_id()[check].evidence
    assert all(w in evidence for w in words), evidence


def test_the_command_line(good, tmp_path):
    broken = broken_copy(good, tmp_path, rope_dropped)
    run = [sys.executable, "-m", "apertus_plugins.cli", "doctor"]
    ok = subprocess.run(run + [str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "13 checks: 13 pass, 0 warn, 0 fail" in ok.stdout
    bad = subprocess.run(run + [str(broken), "--json", "--compare", str(good)], capture_output=True, text=True)
    assert bad.returncode == 1, bad.stderr
    data = json.loads(bad.stdout)
    failed = {c["id"] for c in data["checks"] if c["status"] == "fail"}
    assert failed == {"config.rope", "compare.rope"} and data["ok"] is False
    missing = subprocess.run(run + [str(tmp_path / "nope")], capture_output=True, text=True)
    assert missing.returncode == 2 and "'" + str(tmp_path / "nope") + "': no such file or directory" in missing.stderr
    assert "not a Hub model id" in missing.stderr
