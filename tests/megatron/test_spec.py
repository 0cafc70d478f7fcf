"""The Apertus layer spec on CPU: constructed by megatron-core, names mapped by the converter, xIELU per layer.

Also the Apertus weight-decay rule inside megatron-core's own optimizer construction: norm gains
and the xIELU scalars are decayed (upstream skips every 1-D parameter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import tiny_text_config

from apertus_plugins.core import xielu
from megatron_patches.checkpoint import build_cpu_model, transformer_config
from megatron_patches.convert import HF_PREFIX_15, ModelShape, megatron_names, megatron_to_hf
from megatron_patches.spec import XIELU, ApertusMLP, apertus_layer_spec, build_gpt_model, local_to_checkpoint_name

SHAPE = ModelShape.from_hf_config(tiny_text_config())


def test_layer_spec_and_names(process_group: None) -> None:
    model = build_cpu_model(SHAPE)
    spec = apertus_layer_spec()
    names = [local_to_checkpoint_name(n, spec) for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(megatron_names(SHAPE.num_layers))
    # every Megatron name has a released name, and the released layout comes out whole
    tensors = {local_to_checkpoint_name(n, spec): p.detach() for n, p in model.named_parameters()}
    hf = megatron_to_hf(tensors, SHAPE)
    layer = {k[len(HF_PREFIX_15 + "layers.0."):] for k in hf if k.startswith(HF_PREFIX_15 + "layers.0.")}
    assert layer == {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                     "attention_layernorm.weight", "feedforward_layernorm.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight", "mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n", "mlp.act_fn.beta",
                     "mlp.act_fn.eps"}
    assert {"lm_head.weight", HF_PREFIX_15 + "embed_tokens.weight", HF_PREFIX_15 + "norm.weight"} <= set(hf)
    # the checkpoint keys megatron-core writes use the same (Transformer Engine style) names
    sharded = {v.key for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in sharded
    assert "decoder.layers.mlp.activation_func.alpha_p" in sharded


def test_xielu_is_a_module_per_layer(process_group: None) -> None:
    model = build_cpu_model(SHAPE, torch.bfloat16)
    acts = [layer.mlp.activation_func for layer in model.decoder.layers]
    assert all(isinstance(layer.mlp, ApertusMLP) and isinstance(a, XIELU) for layer, a in
               zip(model.decoder.layers, acts, strict=True))
    assert acts[0].alpha_p is not acts[1].alpha_p
    p, n = xielu.initial_parameters(torch.bfloat16)
    assert torch.equal(acts[0].alpha_p.data, p) and torch.equal(acts[0].alpha_n.data, n)  # the port's init
    assert all(a.alpha_p.requires_grad and a.alpha_n.requires_grad for a in acts)
    assert "decoder.layers.0.mlp.activation_func.beta" not in model.state_dict()  # constants, not weights


def test_mlp_forward_and_gradients(process_group: None) -> None:
    """megatron-core's MLP with the Apertus activation computes down(xIELU(up(x))); alpha gets gradients."""
    model = build_cpu_model(SHAPE)
    mlp = model.decoder.layers[1].mlp
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(7, 3, SHAPE.hidden_size, generator=g)
    out, bias = mlp(x)
    assert bias is None
    act = mlp.activation_func
    want = xielu.xielu(x @ mlp.linear_fc1.weight.T, act.alpha_p, act.alpha_n) @ mlp.linear_fc2.weight.T
    assert torch.allclose(out, want, atol=1e-5)
    out.square().sum().backward()
    assert act.alpha_p.grad is not None and act.alpha_p.grad.abs().item() > 0
    assert act.alpha_n.grad is not None and act.alpha_n.grad.abs().item() > 0


def test_xielu_formula() -> None:
    x = torch.tensor([-30.0, -2.0, -1e-7, 0.0, 1e-7, 0.5, 3.0], dtype=torch.float64)
    p, n = xielu.initial_parameters(torch.float64)
    a_p = torch.nn.functional.softplus(p)
    a_n = 0.5 + torch.nn.functional.softplus(n)
    assert torch.allclose(a_p, torch.tensor([0.8], dtype=torch.float64))
    assert torch.allclose(a_n, torch.tensor([0.8], dtype=torch.float64))
    want = torch.where(x > 0, a_p * x * x + 0.5 * x, a_n * (torch.expm1(torch.clamp(x, max=-1e-6)) - x) + 0.5 * x)
    assert torch.allclose(xielu.xielu(x, p, n), want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("change,flag", [
    ({"gated_linear_unit": True}, "--swiglu"),
    ({"add_bias_linear": True}, "--disable-bias-linear"),
    ({"qk_layernorm": False}, "--qk-layernorm"),
    ({"normalization": "LayerNorm"}, "--normalization RMSNorm"),
])
def test_not_an_apertus_config(change: dict[str, Any], flag: str, process_group: None) -> None:
    cfg = transformer_config(SHAPE)
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match=f"not an Apertus decoder: .*{flag}"):
        build_gpt_model(cfg, vocab_size=1100, max_sequence_length=64, rotary_base=10000, rope_scaling=False,
                        rope_scaling_factor=8.0)


def param_groups(model: Any, rule: str) -> list[dict[str, Any]]:
    """megatron-core's own parameter groups (upstream's weight-decay overrides), then the Apertus rule.

    (megatron-core's optimizer wrappers allocate on CUDA, so the groups are checked here and the
    wrapped construction runs in the GPU script.)"""
    import megatron.core.optimizer as mco
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patches.optimizer import apply_weight_decay_rule

    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1)
    groups = mco._get_param_groups([model], cfg, mco.get_standard_config_overrides(cfg))
    apply_weight_decay_rule(groups, rule)
    return groups


def test_weight_decay_on_every_parameter(process_group: None) -> None:
    model = build_cpu_model(SHAPE)
    alpha = model.decoder.layers[0].mlp.activation_func.alpha_p
    norm = model.decoder.layers[0].input_layernorm.weight
    groups = param_groups(model, "all")
    assert all(g["wd_mult"] == 1.0 for g in groups)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    # groups that differed only in weight decay are merged: checkpoints match groups by their settings
    settings = [tuple(sorted((k, str(v)) for k, v in g.items() if k != "params")) for g in groups]
    assert len(settings) == len(set(settings)) and len(groups) < len(param_groups(model, "megatron"))
    skipped = [p for g in param_groups(model, "megatron") if g["wd_mult"] == 0.0 for p in g["params"]]
    assert any(p is alpha for p in skipped) and any(p is norm for p in skipped)  # upstream skips them
