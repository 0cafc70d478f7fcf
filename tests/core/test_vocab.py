"""VocabSpec: the released layout, scaled specs, tokenizer directories, validation errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from apertus_plugins.cli import main as cli_main
from apertus_plugins.core.vocab import OMNI_SLOTS, ModalityRange, VocabError, VocabSpec


def test_released_layout_numbers():
    s = VocabSpec()
    assert s.size == 266_440
    assert s.embedding_rows == 266_752
    assert (s.omni_offset, s.omni_size) == (131_072, 200)
    assert s.modality("image") == ModalityRange("image", 131_272, 131_072)
    assert s.modality("audio") == ModalityRange("audio", 262_344, 4_096)
    assert s.modality("image").end == s.modality("audio").offset
    assert s.id("image") == 131_079 and s.id("audio") == 131_085
    assert [s.id(n) for n in ("stt_transcribe", "stt_continue", "tts_continue")] == [131_082, 131_083, 131_084]
    assert s.id("inner_prefix") == 32 and s.id("inner_suffix") == 33
    assert s.id("tool_output_start") == 73 and s.id("tool_output_end") == 74
    assert s.literal_to_id["<think>"] == 32 and s.literal_to_id["</think>"] == 33
    assert s.literal_to_id["<image>"] == 131_079 and s.literal_to_id["<audio>"] == 131_085


def test_special_ids_of_the_default_spec():
    s = VocabSpec()
    expected = set(range(0, 4)) | set(range(61, 69)) | set(range(71, 75)) | set(range(131_072, 131_272))
    assert s.special_ids == expected
    assert 32 not in s.special_ids and 33 not in s.special_ids
    assert {32, 33} <= s.structure_ids
    table = s.special_mask()
    assert table.sum() == len(expected) and table[131_100] and not table[131_272]


def test_scaled_spec_keeps_the_structure():
    s = VocabSpec.scaled()
    assert s.omni_offset == s.text_size == 512
    assert s.modality("image").offset == 712 and s.modality("audio").end == s.size
    for slot, (name, _lit) in OMNI_SLOTS.items():
        assert s.id(name) == 512 + slot
    assert list(s.modality_of([5, 512, 712, 968])) == [0, 1, 2, 3]
    assert list(s.code_to_id("audio", [0, 63])) == [968, 1031]
    with pytest.raises(VocabError, match="audio codes must lie in 0..63"):
        s.code_to_id("audio", [64])


def test_validation_errors_name_the_problem():
    with pytest.raises(VocabError, match="overlap"):
        VocabSpec(modalities=(ModalityRange("image", 131_200, 131_072), ModalityRange("audio", 262_344, 4096)))
    with pytest.raises(VocabError, match="embedding has 266000"):
        VocabSpec(embedding_rows=266_000)
    slots = dict(OMNI_SLOTS)
    del slots[7]
    with pytest.raises(VocabError, match="omni markers missing: image"):
        VocabSpec(slots=slots)
    with pytest.raises(VocabError, match="text range"):
        VocabSpec.scaled(text_size=64)
    with pytest.raises(VocabError, match="share id"):
        VocabSpec(chat_ids={**VocabSpec().chat_ids, "pad": 2})
    with pytest.raises(VocabError, match="the embedding has 100 rows but the vocabulary needs 1032"):
        VocabSpec.scaled().check_embedding(100)


@pytest.mark.parametrize("which", ["small", "full"])
def test_spec_round_trips_through_a_tokenizer_dir(which, apertus_tokenizer_dir, apertus_full_tokenizer_dir):
    path = apertus_tokenizer_dir if which == "small" else apertus_full_tokenizer_dir
    want = VocabSpec.scaled() if which == "small" else VocabSpec()
    got = VocabSpec.from_tokenizer_dir(path)
    assert got.size == want.size == got.total_size
    assert got.modalities == want.modalities
    assert got.chat_ids == want.chat_ids
    assert got.name_to_id == want.name_to_id
    # the tokenizer's own <SPECIAL_N> reservations join the special ids, the delimiters do not
    assert got.special_ids > want.special_ids
    assert 32 not in got.special_ids


def test_layout_inferred_without_omnimodal_config(tmp_path, apertus_tokenizer_dir):
    d = tmp_path / "tok"
    shutil.copytree(apertus_tokenizer_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["omnimodal_config"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert VocabSpec.from_tokenizer_dir(d).modalities == VocabSpec.scaled().modalities


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_sft_boundary_disagreement_is_an_error(tmp_path, apertus_tokenizer_dir):
    d = _edit_config(apertus_tokenizer_dir, tmp_path / "tok", sft_eot_token="</s>")
    with pytest.raises(VocabError, match="sft_eot_token is '</s>'.*<\\|assistant_end\\|>"):
        VocabSpec.from_tokenizer_dir(d)


def test_omnimodal_config_that_contradicts_the_markers_is_an_error(tmp_path, apertus_tokenizer_dir):
    cfg = VocabSpec.scaled().omnimodal_config()
    cfg["special_token_offset"] = 500
    d = _edit_config(apertus_tokenizer_dir, tmp_path / "tok", omnimodal_config=cfg)
    with pytest.raises(VocabError, match="marker '<\\|img_start\\|>' is id 513, but omni slot 1 is id 501"):
        VocabSpec.from_tokenizer_dir(d)


def test_layout_that_does_not_fit_the_embedding(apertus_tokenizer_dir):
    with pytest.raises(VocabError, match="embedding has 1000"):
        VocabSpec.from_tokenizer_dir(apertus_tokenizer_dir, embedding_rows=1000)


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(VocabError, match="no tokenizer.json"):
        VocabSpec.from_tokenizer_dir(tmp_path)


def test_hf_tokenizer_from_the_builder(apertus_tokenizer_dir, apertus_small_spec):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(apertus_tokenizer_dir)
    assert len(tok) == apertus_small_spec.size
    assert tok.eos_token == "</s>" and tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.convert_tokens_to_ids("<think>") is not None
    assert tok.encode("<think>", add_special_tokens=False) == [32]
    assert tok.encode("<|inner_prefix|>", add_special_tokens=False) == [32]
    assert tok.encode("</think>", add_special_tokens=False) == [33]
    assert tok.encode("<image>", add_special_tokens=False) == [apertus_small_spec.id("image")]
    assert tok.encode("<audio>", add_special_tokens=False) == [apertus_small_spec.id("audio")]
    assert tok.encode("<thought>x</thought>", add_special_tokens=False)[::2] == [32, 33]
    assert tok.convert_tokens_to_ids("<|visual token 0|>") == apertus_small_spec.modality("image").offset
    assert tok.convert_tokens_to_ids("<|audio token 0|>") == apertus_small_spec.modality("audio").offset
    assert tok.convert_tokens_to_ids("<|tool_output_start|>") == 73
    ids = tok.encode("<think>plan</think>answer")
    assert ids[0] == 1
    # the delimiters are not special: they survive skip_special_tokens
    assert tok.decode(ids, skip_special_tokens=True) == "<|inner_prefix|>plan<|inner_suffix|>answer"
    # the processor's media tokens
    assert tok.image_token == "<|image|>" and tok.boi_token == "<|img_start|>" and tok.eol_token == "<|img_end_of_row|>"
    assert tok.boa_token == "<|audio_start|>" and tok.eoa_token == "<|audio_end|>"


def test_cli_vocab(apertus_tokenizer_dir, capsys):
    assert cli_main(["vocab", str(apertus_tokenizer_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == 1032 and out["modalities"]["image"] == [712, 967]
    assert cli_main(["vocab", str(apertus_tokenizer_dir)]) == 0
    assert "omni block     512..711" in capsys.readouterr().out
    assert cli_main(["vocab", str(apertus_tokenizer_dir), "--embedding-rows", "10"]) == 1
    assert "but the embedding has 10" in capsys.readouterr().err
