"""The Apertus decoder layer as a megatron-core layer spec (SPEC.md section 5).

Pre-norm RMSNorm, QK-norm, no biases and a non-gated MLP ``linear_fc2(xIELU(linear_fc1(x)))``. The
spec is megatron-core's own GPT layer spec (local or Transformer Engine) with the MLP swapped for
:class:`ApertusMLP`, whose activation is a per-layer :class:`XIELU` module: ``alpha_p``/``alpha_n``
are parameters of every layer (``decoder.layers.N.mlp.activation_func.alpha_{p,n}``), trained and,
under the Apertus recipe, weight-decayed. The math is :mod:`apertus_plugins.core.xielu`, run as its
fused autograd function (:func:`~apertus_plugins.core.xielu.xielu_fused`: only the activation's input
is kept for the backward pass, as GeLU keeps, and the values and gradients are the composed
formula's, bit for bit).

Build a model with :func:`build_gpt_model` (what the launcher's model provider calls); it passes
``--rope-scaling-factor`` to ``GPTModel``, which upstream's GPT builder does not.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from apertus_plugins.core import xielu as _xielu

from .version import require_supported

# the version check follows the imports (import order): an unsupported megatron-core stops here with the
# supported range, before anything of this module is defined or run
require_supported()

__all__ = ["XIELU", "ApertusMLP", "apertus_layer_spec", "check_apertus_config", "build_gpt_model",
           "local_to_checkpoint_name", "checkpoint_to_local_name"]


class XIELU(MegatronModule):
    """xIELU with its own trainable ``alpha_p``/``alpha_n`` (shape ``[1]``, stored pre-softplus).

    ``beta`` and ``eps`` are non-persistent buffers (constants, in the parameter dtype as the port
    keeps them). The MLP's intermediate activations are split across tensor-parallel ranks, so the
    scalars pass through ``copy_to_tensor_model_parallel_region``: identity forward, gradients
    summed over the tensor-parallel group backward (each rank sees only its slice of features).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config=config)
        dtype = config.params_dtype
        p, n = _xielu.initial_parameters(dtype=dtype)
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.alpha_p = torch.nn.Parameter(p.to(device=device, dtype=dtype))
        self.alpha_n = torch.nn.Parameter(n.to(device=device, dtype=dtype))
        self.register_buffer("beta", torch.tensor(_xielu.BETA, dtype=dtype, device=device), persistent=False)
        self.register_buffer("eps", torch.tensor(_xielu.EPS, dtype=dtype, device=device), persistent=False)

    #: Run :func:`apertus_plugins.core.xielu.xielu_fused` (True) or the composed :func:`~apertus_plugins.core.xielu.xielu`
    #: (same values and gradients, about four times the activation's size kept for the backward pass).
    fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a_p = copy_to_tensor_model_parallel_region(self.alpha_p)
        a_n = copy_to_tensor_model_parallel_region(self.alpha_n)
        fn = _xielu.xielu_fused if self.fused else _xielu.xielu
        return fn(x, a_p, a_n, self.beta.to(x.dtype), self.eps.to(x.dtype))


class ApertusMLP(MLP):
    """megatron-core's MLP with a per-layer :class:`XIELU` as ``activation_func`` (non-gated, no bias)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, **kwargs: Any) -> None:
        check_apertus_config(config)
        super().__init__(config, submodules, **kwargs)
        self.activation_func = XIELU(config)


def check_apertus_config(config: TransformerConfig) -> None:
    """Raise ``ValueError`` naming the Megatron flag when ``config`` is not an Apertus decoder."""
    problems = []
    if config.gated_linear_unit:
        problems.append("the MLP is gated (drop --swiglu / --quick-geglu: the Apertus MLP is non-gated)")
    if config.add_bias_linear:
        problems.append("linear layers have biases (pass --disable-bias-linear)")
    if config.bias_activation_fusion:
        problems.append("bias-activation fusion is on (xIELU cannot be fused; pass --no-bias-gelu-fusion)")
    if getattr(config, "use_te_activation_func", False):
        problems.append("use_te_activation_func is set (xIELU is not a Transformer Engine activation)")
    if config.normalization != "RMSNorm":
        problems.append(f"normalization is {config.normalization} (pass --normalization RMSNorm)")
    if not config.qk_layernorm:
        problems.append("QK-norm is off (pass --qk-layernorm)")
    if config.num_moe_experts:
        problems.append("the model has MoE experts (Apertus is dense)")
    if problems:
        raise ValueError("not an Apertus decoder: " + "; ".join(problems))


def apertus_layer_spec(use_transformer_engine: bool = False) -> ModuleSpec:
    """megatron-core's GPT layer spec (local modules, or Transformer Engine) with the Apertus MLP."""
    if use_transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    mlp = spec.submodules.mlp
    if isinstance(mlp, ModuleSpec) and mlp.module is MLP:  # 0.16: a ModuleSpec
        spec.submodules.mlp = ModuleSpec(module=ApertusMLP, submodules=mlp.submodules, params=dict(mlp.params))
    elif isinstance(mlp, functools.partial) and getattr(mlp.func, "__self__", None) is MLP \
            and mlp.func.__name__ == "as_mlp_submodule":  # 0.19: partial(MLP.as_mlp_submodule, submodules=...)
        spec.submodules.mlp = functools.partial(ApertusMLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    else:
        raise RuntimeError(f"unexpected MLP spec in megatron-core's GPT layer spec: {mlp!r}")
    return spec


def local_to_checkpoint_name(name: str, spec: ModuleSpec) -> str:
    """A model ``state_dict`` name -> its checkpoint (Transformer Engine style) name.

    The local spec keeps the pre-norms as ``input_layernorm``/``pre_mlp_layernorm``; its
    ``sharded_state_dict_keys_map`` renames them to ``linear_qkv.layer_norm_weight``/
    ``linear_fc1.layer_norm_weight`` in checkpoints, the names Transformer Engine layers use.
    """
    keys_map = getattr(spec.submodules, "sharded_state_dict_keys_map", None) or {}
    prefix = "decoder.layers."
    if name.startswith(prefix):
        layer, _, rest = name[len(prefix):].partition(".")
        for old, new in keys_map.items():
            if rest.startswith(old):
                return f"{prefix}{layer}.{new}{rest[len(old):]}"
    return name


def checkpoint_to_local_name(name: str, spec: ModuleSpec) -> str:
    """Inverse of :func:`local_to_checkpoint_name`: a checkpoint (Transformer Engine style) name -> the
    name the model built from ``spec`` gives it (unchanged where the spec renames nothing)."""
    keys_map = getattr(spec.submodules, "sharded_state_dict_keys_map", None) or {}
    prefix = "decoder.layers."
    if name.startswith(prefix):
        layer, _, rest = name[len(prefix):].partition(".")
        for old, new in keys_map.items():
            if rest.startswith(new):
                return f"{prefix}{layer}.{old}{rest[len(new):]}"
    return name


def build_gpt_model(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    rotary_base: int,
    rope_scaling: bool,
    rope_scaling_factor: float,
    use_transformer_engine: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    **kwargs: Any,
) -> GPTModel:
    """An Apertus ``GPTModel`` (untied embeddings, RoPE with the given llama3 scaling factor)."""
    check_apertus_config(config)
    return GPTModel(
        config=config,
        transformer_layer_spec=apertus_layer_spec(use_transformer_engine),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor,
        **kwargs,
    )
