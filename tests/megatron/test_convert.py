"""Checkpoint conversion between the released transformers layout and Megatron's torch_dist layout.

* transformers -> Megatron -> transformers is bit-identical (tensors, dtypes, the vision and audio
  tokenizers passed through, the config with its RoPE scaling), through ``apertus convert``;
* the Megatron checkpoint is read back by megatron-core's own loader, and its arguments carry
  the RoPE scaling (``--use-rope-scaling``, the factor, the base);
* the fused QKV layout is the one megatron-core's ``SelfAttention`` splits;
* the 1.0 -> 1.5 vocabulary extension and the head pruning;
* unconvertible input fails with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_hf_tensors, tiny_text_config, write_hf_dir

from apertus_plugins.cli import main as apertus
from megatron_patches.checkpoint import load_megatron, save_megatron
from megatron_patches.convert import (
    NEW_ROW_SCALE,
    ConversionError,
    ModelShape,
    RopeScaling,
    fuse_qkv,
    hf_config_from_shape,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    read_hf_checkpoint,
    split_qkv,
)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert bits(a[k]) == bits(b[k]), k


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_text_config()
    return write_hf_dir(tmp_path_factory.mktemp("hf") / "apertus-1.5-tiny", cfg, tiny_hf_tensors(cfg))


def test_round_trip_bit_identical_with_rope(hf_dir: Path, tmp_path: Path, process_group: None,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert apertus(["convert", "to-megatron", str(hf_dir), str(mcore)]) == 0
    flags = capsys.readouterr().out
    assert "--use-rope-scaling --rope-scaling-factor 32.0" in flags and "--rotary-base 4000000" in flags
    # megatron-core's own reader: the arguments hold the RoPE scaling
    tensors, args = load_megatron(mcore)
    assert (args.use_rope_scaling, args.rope_scaling_factor, args.rotary_base) == (True, 32.0, 4000000)
    assert args.padded_vocab_size == 1100 and args.num_query_groups == 2 and args.untie_embeddings_and_output_weights
    assert sorted(tensors) == sorted(megatron_names(2))
    assert tensors["output_layer.weight"].shape[0] == 1100  # the head regrown to every embedding row
    # a run that would load it with other RoPE settings is told so (--use-checkpoint-args keeps only the base)
    from types import SimpleNamespace

    from megatron_patches.checkpoint import read_checkpoint_args, rope_differences

    saved = read_checkpoint_args(mcore)
    same = SimpleNamespace(rotary_base=4000000, use_rope_scaling=True, rope_scaling_factor=32.0,
                           position_embedding_type="rope")
    assert rope_differences(saved, same) == []
    assert rope_differences(saved, SimpleNamespace(**{**vars(same), "rope_scaling_factor": 8.0})) == [
        "rope_scaling_factor: checkpoint 32.0, this run 8.0"]
    assert read_checkpoint_args(tmp_path / "nothing-yet") is None
    assert apertus(["convert", "to-hf", str(mcore), str(back)]) == 0
    src_t, src_cfg, src_side = read_hf_checkpoint(hf_dir)
    out_t, out_cfg, out_side = read_hf_checkpoint(back)
    assert_identical(src_t, out_t)
    assert out_cfg == src_cfg
    assert (back / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    assert out_side == src_side  # generation_config.json travelled both ways
    assert out_cfg["text_config"]["rope_parameters"]["factor"] == 32.0


def test_megatron_rope_reaches_the_config(hf_dir: Path) -> None:
    """The exported config takes RoPE from the Megatron arguments (a context extension changes it)."""
    tensors, config, _ = read_hf_checkpoint(hf_dir)
    shape = ModelShape.from_hf_config(config)
    extended = ModelShape.from_megatron_args({**shape.megatron_args(), "rotary_base": 2_000_000,
                                              "rope_scaling_factor": 16.0}, head_rows=shape.head_rows)
    out = hf_config_from_shape(extended, config)["text_config"]["rope_parameters"]
    assert out == {"rope_type": "llama3", "rope_theta": 2000000.0, "factor": 16.0,
                   "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    # the older config style (rope_theta + rope_scaling) is written in its own style
    old = json.loads(json.dumps(config))
    params = old["text_config"].pop("rope_parameters")
    old["text_config"]["rope_theta"] = params.pop("rope_theta")
    old["text_config"]["rope_scaling"] = params
    assert ModelShape.from_hf_config(old) == shape
    written = hf_config_from_shape(extended, old)["text_config"]
    assert written["rope_theta"] == 2000000.0 and written["rope_scaling"]["factor"] == 16.0
    assert "rope_parameters" not in written


def test_unrepresentable_rope_is_an_error() -> None:
    with pytest.raises(ConversionError, match="low_freq_factor"):
        RopeScaling(theta=4e6, factor=32.0, low_freq_factor=2.0).megatron_args()
    with pytest.raises(ConversionError, match="not an integer"):
        RopeScaling(theta=4e6 + 0.5, factor=32.0).megatron_args()
    with pytest.raises(ConversionError, match="yarn"):
        RopeScaling.from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    assert RopeScaling.from_megatron({"rotary_base": 10000, "use_rope_scaling": False}).megatron_args() == {
        "rotary_base": 10000, "use_rope_scaling": False, "rope_scaling_factor": 8.0}


def test_fused_qkv_is_megatron_cores_layout(process_group: None) -> None:
    """megatron-core's SelfAttention, given the fused weight, produces the HF projections per head."""
    from megatron_patches.checkpoint import build_cpu_model

    cfg = tiny_text_config()
    shape = ModelShape.from_hf_config(cfg)
    model = build_cpu_model(shape)
    attn = model.decoder.layers[0].self_attention
    g = torch.Generator().manual_seed(3)
    h, a, kv, d = 64, 4, 2, 16
    q, k, v = (torch.randn(a * d, h, generator=g), torch.randn(kv * d, h, generator=g),
               torch.randn(kv * d, h, generator=g))
    with torch.no_grad():
        attn.linear_qkv.weight.copy_(fuse_qkv(q, k, v, kv))
        attn.q_layernorm.weight.fill_(1.0)
        attn.k_layernorm.weight.fill_(1.0)
    x = torch.randn(5, 2, h, generator=g)  # [s, b, h]
    query, key, value = attn.get_query_key_value_tensors(x)[:3]

    def rms(t: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + shape.norm_epsilon)

    assert torch.allclose(query, rms((x @ q.T).reshape(5, 2, a, d)), atol=1e-5)
    assert torch.allclose(key, rms((x @ k.T).reshape(5, 2, kv, d)), atol=1e-5)
    assert torch.allclose(value, (x @ v.T).reshape(5, 2, kv, d), atol=1e-6)
    assert all(torch.equal(x1, x2) for x1, x2 in zip(split_qkv(fuse_qkv(q, k, v, kv), a, kv, d), (q, k, v),
                                                       strict=True))


def test_vocabulary_extension_and_head_pruning(tmp_path: Path, process_group: None) -> None:
    """An Apertus 1.0 checkpoint grown to a 1.5 vocabulary; the released head keeps the text rows."""
    cfg10 = {"model_type": "apertus", **tiny_text_config(vocab_size=512, output_vocab_size=None)["text_config"]}
    cfg10["model_type"] = "apertus"
    t10 = tiny_hf_tensors(cfg10, prefix="model.", dtype=torch.float32)
    shape10 = ModelShape.from_hf_config(cfg10)
    conv = hf_to_megatron(t10, shape10, embedding_rows=1100, seed=7)
    emb, head = conv.tensors["embedding.word_embeddings.weight"], conv.tensors["output_layer.weight"]
    assert emb.shape == head.shape == (1100, 64)
    assert torch.equal(emb[:512], t10["model.embed_tokens.weight"])
    assert torch.equal(head[:512], t10["lm_head.weight"])
    for new, old in ((emb, t10["model.embed_tokens.weight"]), (head, t10["lm_head.weight"])):
        norms = new[512:].norm(dim=1)
        target = NEW_ROW_SCALE * old.norm(dim=1).mean()
        assert torch.allclose(norms, torch.full_like(norms, float(target)), rtol=1e-4)
        assert new[512:].std(dim=0).min() > 0  # random directions, not one repeated row
    # seeded: the same rows again
    again = hf_to_megatron(t10, shape10, embedding_rows=1100, seed=7)
    assert torch.equal(again.tensors["embedding.word_embeddings.weight"], emb)
    # saved and exported as 1.5 with the released head of 512 text rows
    mcore = save_megatron(conv, tmp_path / "m", hf_config=cfg10)
    tensors, args = load_megatron(mcore)
    shape = ModelShape.from_megatron_args(args, head_rows=512)
    hf = megatron_to_hf(tensors, shape, conv.passthrough)
    assert hf["lm_head.weight"].shape == (512, 64) and torch.equal(hf["lm_head.weight"], t10["lm_head.weight"])
    assert hf["model.language_model.embed_tokens.weight"].shape == (1100, 64)
    assert "model.language_model.layers.0.mlp.act_fn.beta" in hf
    with pytest.raises(ConversionError, match="not an Apertus 1.5 config"):
        hf_config_from_shape(shape, cfg10)  # a 1.0 config cannot describe the 1.5 model
    out = hf_config_from_shape(shape, tiny_text_config())
    assert out["text_config"]["vocab_size"] == 1100 and out["text_config"]["output_vocab_size"] == 512


def test_bad_input_errors(hf_dir: Path, tmp_path: Path) -> None:
    tensors, config, _ = read_hf_checkpoint(hf_dir)
    shape = ModelShape.from_hf_config(config)
    with pytest.raises(ConversionError, match="model.foo: neither a language-model tensor"):
        hf_to_megatron({**tensors, "model.foo": torch.zeros(1)}, shape)
    eps = "model.language_model.layers.1.mlp.act_fn.eps"
    with pytest.raises(ConversionError, match=r"act_fn\.eps is .* the Megatron xIELU uses the constant"):
        hf_to_megatron({**tensors, eps: torch.tensor(-1e-3, dtype=torch.bfloat16)}, shape)
    missing = {k: v for k, v in tensors.items() if "layers.0.self_attn.k_proj" not in k}
    with pytest.raises(ConversionError, match="layer 0: q/k/v projections missing"):
        hf_to_megatron(missing, shape)
    with pytest.raises(ConversionError, match="tie_word_embeddings"):
        ModelShape.from_hf_config(tiny_text_config(tie_word_embeddings=True))
    with pytest.raises(ConversionError, match="xIELU"):
        ModelShape.from_hf_config(tiny_text_config(hidden_act="silu"))
    assert apertus(["convert", "to-hf", str(tmp_path), str(tmp_path / "o")]) == 1  # not a checkpoint
    assert apertus(["convert", "to-megatron", str(tmp_path), str(tmp_path / "o")]) == 1
