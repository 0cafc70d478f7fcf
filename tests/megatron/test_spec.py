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
from apertus_plugins.testing.memory import saved_tensor_bytes
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


# ------------------------------------------------------------------------------ the fused xIELU
def _saved_activation_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the non-parameter tensors autograd keeps for the backward pass of ``module(x)``."""
    return saved_tensor_bytes(lambda: module(x), module.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_xielu_equals_the_formula_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3, 70_000, generator=g) * 3).to(dtype)  # several blocks, a partial last one
    x.view(-1)[:4] = torch.tensor([0.0, xielu.EPS, -0.0, 1e-30]).to(dtype)  # the branch points themselves
    p, n = xielu.initial_parameters(dtype)
    p, n = (p + 0.3).requires_grad_(), (n - 0.2).requires_grad_()
    beta, eps = torch.tensor(xielu.BETA, dtype=dtype), torch.tensor(xielu.EPS, dtype=dtype)
    grad = torch.randn(x.shape, generator=g).to(dtype)
    outs = []
    for fn in (xielu.xielu, xielu.xielu_fused):
        xi = x.clone().requires_grad_()
        y = fn(xi, p, n, beta, eps)
        outs.append((y, *torch.autograd.grad(y, (xi, p, n), grad)))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_apertus_mlp_keeps_no_more_activations_than_gelu(process_group: None) -> None:
    """Measured: the Apertus MLP (fused xIELU) keeps what megatron-core's GeLU MLP keeps for backward; the composed
    formula kept over three more activation-sized tensors. Outputs and gradients are the same either way."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    cfg = transformer_config(SHAPE)
    apertus = build_cpu_model(SHAPE).decoder.layers[0].mlp
    gelu_cfg = transformer_config(SHAPE)
    gelu_cfg.activation_func = torch.nn.functional.gelu
    gelu = build_module(get_gpt_layer_local_spec().submodules.mlp, config=gelu_cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (apertus, gelu):
            for q in module.parameters():
                q.copy_(torch.randn(q.shape, generator=g) * 0.2)
    x = torch.randn(64, 2, cfg.hidden_size, generator=g)
    fused = _saved_activation_bytes(apertus, x)
    stock = _saved_activation_bytes(gelu, x)
    apertus.activation_func.fused = False
    try:
        composed = _saved_activation_bytes(apertus, x)
        want = apertus(x)[0]
        want_grads = torch.autograd.grad(want.square().sum(), list(apertus.parameters()))
    finally:
        apertus.activation_func.fused = True
    got = apertus(x)[0]
    got_grads = torch.autograd.grad(got.square().sum(), list(apertus.parameters()))
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    ffn_tensor = 64 * 2 * cfg.ffn_hidden_size * 4
    assert fused <= stock, (fused, stock)
    assert composed >= stock + 3 * ffn_tensor, (composed, stock)
    print(f"MLP activations kept for backward: GeLU {stock / 2**10:.0f} KiB, xIELU fused {fused / 2**10:.0f} KiB, "
          f"composed {composed / 2**10:.0f} KiB")
