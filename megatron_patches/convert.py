"""Checkpoint tensors between the released ``transformers`` layout and Megatron-core's (SPEC.md section 5).

Pure mapping over dictionaries of torch tensors; reading and writing files is the caller's job
(``apertus convert``, and ``megatron_patches.checkpoint`` for Megatron's distributed format).

* Names (per layer ``N``; Megatron names as megatron-core's checkpoints spell them)::

    model.language_model.embed_tokens.weight                  embedding.word_embeddings.weight
    model.language_model.layers.N.self_attn.{q,k,v}_proj      decoder.layers.N.self_attention.linear_qkv.weight
    model.language_model.layers.N.self_attn.o_proj            decoder.layers.N.self_attention.linear_proj.weight
    model.language_model.layers.N.self_attn.{q,k}_norm        decoder.layers.N.self_attention.{q,k}_layernorm.weight
    model.language_model.layers.N.attention_layernorm         decoder.layers.N.self_attention.linear_qkv.layer_norm_weight
    model.language_model.layers.N.feedforward_layernorm       decoder.layers.N.mlp.linear_fc1.layer_norm_weight
    model.language_model.layers.N.mlp.up_proj                 decoder.layers.N.mlp.linear_fc1.weight
    model.language_model.layers.N.mlp.down_proj               decoder.layers.N.mlp.linear_fc2.weight
    model.language_model.layers.N.mlp.act_fn.alpha_{p,n}      decoder.layers.N.mlp.activation_func.alpha_{p,n}
    model.language_model.norm.weight                          decoder.final_layernorm.weight
    lm_head.weight                                            output_layer.weight

  Apertus 1.0 checkpoints (``model_type`` ``apertus``) hold the same names under ``model.``.
* Fused QKV: megatron-core interleaves by query group: for each of the ``G`` groups, the rows of
  its ``A/G`` query heads, then its key head, then its value head (``head_dim`` rows each).
* Everything outside the language model (``model.vision_tokenizer.*``, ``model.audio_tokenizer.*``)
  and the xIELU constants the port also saves (``mlp.act_fn.beta``/``eps``, checked against
  SPEC's values) pass through untouched, to be written back as they came.
* The LM head: the released head keeps only the text rows (``output_vocab_size``); Megatron's has
  one row per embedding row. Going to Megatron, the missing rows are new rows; going back, the
  head is pruned to ``output_vocab_size`` (text logits are unchanged).
* New rows (the 1.0 -> 1.5 vocabulary extension, and the re-grown head rows) are random
  directions scaled to a tenth of the mean norm of the existing rows (``NEW_ROW_SCALE``).
* RoPE: llama3 scaling maps to Megatron's ``--use-rope-scaling --rope-scaling-factor`` and
  ``--rotary-base``; megatron-core fixes the other llama3 constants (:data:`MEGATRON_LLAMA3_FIXED`),
  so a configuration it cannot represent is an error, never a silent drop (report 3.4).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from apertus_plugins.core import xielu as _xielu
from apertus_plugins.core.release import (
    ROPE_FACTOR,
    ROPE_HIGH_FREQ_FACTOR,
    ROPE_LOW_FREQ_FACTOR,
    ROPE_ORIGINAL_CONTEXT,
    ROPE_THETA,
    ROPE_TYPE,
)
from apertus_plugins.core.tensor_names import ENCODER_PREFIXES, LANGUAGE_MODEL_PREFIX, LM_HEAD

__all__ = [
    "ConversionError",
    "HF_PREFIX_15",
    "HF_PREFIX_10",
    "PASSTHROUGH_PREFIXES",
    "NEW_ROW_SCALE",
    "MEGATRON_LLAMA3_FIXED",
    "RopeScaling",
    "ModelShape",
    "ConvertedWeights",
    "fuse_qkv",
    "split_qkv",
    "new_rows",
    "extend_rows",
    "hf_to_megatron",
    "megatron_to_hf",
    "megatron_names",
    "name_pairs",
    "qkv_names",
    "check_xielu_constant",
    "hf_config_from_shape",
]

HF_PREFIX_15 = LANGUAGE_MODEL_PREFIX
HF_PREFIX_10 = "model."
#: Tensors outside the language model, written back unchanged.
PASSTHROUGH_PREFIXES = ENCODER_PREFIXES
#: Fraction of the mean norm of the existing rows given to new embedding/head rows (SPEC.md 5).
NEW_ROW_SCALE = 0.1
#: The llama3 constants megatron-core's ``RotaryEmbedding`` applies (it exposes only the factor).
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": ROPE_LOW_FREQ_FACTOR, "high_freq_factor": ROPE_HIGH_FREQ_FACTOR,
                         "original_max_position_embeddings": ROPE_ORIGINAL_CONTEXT}


class ConversionError(ValueError):
    """A checkpoint or configuration that cannot be converted without losing something."""


# ---------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class RopeScaling:
    """RoPE parameters: ``rope_type`` ``"llama3"`` (with ``factor`` and the llama3 constants) or ``"default"``."""

    theta: float
    rope_type: str = ROPE_TYPE
    factor: float = 1.0
    original_max_position_embeddings: int = ROPE_ORIGINAL_CONTEXT
    low_freq_factor: float = ROPE_LOW_FREQ_FACTOR
    high_freq_factor: float = ROPE_HIGH_FREQ_FACTOR

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> RopeScaling:
        """From a text config: ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (4.x)."""
        params = cfg.get("rope_parameters")
        if params is None:
            params = dict(cfg.get("rope_scaling") or {})
            if "rope_theta" in cfg:
                params["rope_theta"] = cfg["rope_theta"]
            if "type" in params and "rope_type" not in params:
                params["rope_type"] = params["type"]
        if "rope_theta" not in params:
            raise ConversionError("the text config has no rope_theta (rope_parameters or rope_theta)")
        rope_type = params.get("rope_type", "default")
        if rope_type not in (ROPE_TYPE, "default"):
            raise ConversionError(f"rope_type {rope_type!r} has no Megatron equivalent here ({ROPE_TYPE} or default)")
        if rope_type == "default":
            return cls(theta=float(params["rope_theta"]), rope_type="default")
        missing = [k for k in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
                   if k not in params]
        if missing:
            raise ConversionError(f"llama3 rope_parameters lack {missing}")
        return cls(theta=float(params["rope_theta"]), rope_type=ROPE_TYPE, factor=float(params["factor"]),
                   original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                   low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]))

    def hf_parameters(self) -> dict[str, Any]:
        """The ``rope_parameters`` dictionary of a transformers 5 config."""
        if self.rope_type == "default":
            return {"rope_type": "default", "rope_theta": self.theta}
        return {"rope_type": ROPE_TYPE, "rope_theta": self.theta, "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor}

    def megatron_args(self) -> dict[str, Any]:
        """``rotary_base``, ``use_rope_scaling``, ``rope_scaling_factor``; raises if Megatron cannot hold it."""
        if self.theta != int(self.theta):
            raise ConversionError(f"rope_theta {self.theta} is not an integer; Megatron's --rotary-base is an int")
        out: dict[str, Any] = {"rotary_base": int(self.theta), "use_rope_scaling": self.rope_type == ROPE_TYPE,
                               "rope_scaling_factor": self.factor if self.rope_type == ROPE_TYPE else 8.0}
        if self.rope_type == ROPE_TYPE:
            got = {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                   "original_max_position_embeddings": self.original_max_position_embeddings}
            bad = {k: v for k, v in got.items() if float(v) != float(MEGATRON_LLAMA3_FIXED[k])}
            if bad:
                raise ConversionError(
                    f"megatron-core applies llama3 RoPE scaling with {MEGATRON_LLAMA3_FIXED}; this checkpoint has "
                    f"{bad}, which a Megatron run cannot reproduce")
        return out

    @classmethod
    def from_megatron(cls, args: Any) -> RopeScaling:
        """From Megatron arguments (a namespace or mapping with ``rotary_base``, ``use_rope_scaling``...)."""
        get = args.get if isinstance(args, Mapping) else (lambda k, d=None: getattr(args, k, d))
        theta = get("rotary_base")
        if theta is None:
            raise ConversionError("the Megatron arguments have no rotary_base")
        if get("position_embedding_type", "rope") != "rope":
            raise ConversionError(f"position_embedding_type {get('position_embedding_type')!r}: Apertus uses rope")
        if not get("use_rope_scaling", False):
            return cls(theta=float(theta), rope_type="default")
        return cls(theta=float(theta), rope_type=ROPE_TYPE, factor=float(get("rope_scaling_factor", 8.0)),
                   **{k: type(v)(v) for k, v in MEGATRON_LLAMA3_FIXED.items()})


@dataclass(frozen=True)
class ModelShape:
    """The decoder's dimensions, vocabulary rows and RoPE, shared by both layouts."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    embedding_rows: int
    head_rows: int
    norm_epsilon: float
    max_position_embeddings: int
    rope: RopeScaling = field(default_factory=lambda: RopeScaling(theta=ROPE_THETA, factor=ROPE_FACTOR))

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(f"{self.num_attention_heads} attention heads do not split into "
                                  f"{self.num_query_groups} query groups")
        if not 0 < self.head_rows <= self.embedding_rows:
            raise ConversionError(f"the LM head has {self.head_rows} rows; it must have 1..{self.embedding_rows} "
                                  "(the embedding rows)")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a released config (``apertus1p5`` with ``text_config``, or a text config / Apertus 1.0)."""
        text = config.get("text_config", config)
        heads = int(text["num_attention_heads"])
        groups = int(text.get("num_key_value_heads") or heads)
        hidden = int(text["hidden_size"])
        head_dim = int(text.get("head_dim") or hidden // heads)
        act = text.get("hidden_act", "xielu")
        if act != "xielu":
            raise ConversionError(f"hidden_act is {act!r}; the Apertus MLP is xIELU")
        if text.get("attention_bias") or text.get("mlp_bias"):
            raise ConversionError("the Apertus decoder has no biases (attention_bias/mlp_bias are set)")
        if text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
            raise ConversionError("tie_word_embeddings is set; Apertus keeps untied input and output embeddings")
        rows = int(text["vocab_size"])
        return cls(num_layers=int(text["num_hidden_layers"]), hidden_size=hidden,
                   ffn_hidden_size=int(text["intermediate_size"]), num_attention_heads=heads, num_query_groups=groups,
                   kv_channels=head_dim, embedding_rows=rows, head_rows=int(text.get("output_vocab_size") or rows),
                   norm_epsilon=float(text.get("rms_norm_eps", 1e-5)),
                   max_position_embeddings=int(text.get("max_position_embeddings", 65536)),
                   rope=RopeScaling.from_hf(text))

    def megatron_args(self) -> dict[str, Any]:
        """The Megatron-LM arguments of this model (as ``argparse`` destinations; the norm epsilon under
        both its 0.16+ name ``layernorm_epsilon`` and the older ``norm_epsilon``)."""
        out = {
            "num_layers": self.num_layers, "hidden_size": self.hidden_size, "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "group_query_attention": self.num_query_groups != self.num_attention_heads,
            "num_query_groups": self.num_query_groups, "kv_channels": self.kv_channels,
            "normalization": "RMSNorm", "layernorm_epsilon": self.norm_epsilon, "norm_epsilon": self.norm_epsilon,
            "qk_layernorm": True,
            "add_bias_linear": False, "add_qkv_bias": False, "swiglu": False,
            "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope", "rotary_percent": 1.0,
            "max_position_embeddings": self.max_position_embeddings, "padded_vocab_size": self.embedding_rows,
        }
        out.update(self.rope.megatron_args())
        return out

    def megatron_flags(self) -> list[str]:
        """Command-line flags for ``pretrain_gpt.py`` (with ``apertus-megatron``) that build this model."""
        a = self.megatron_args()
        flags = ["--num-layers", str(a["num_layers"]), "--hidden-size", str(a["hidden_size"]),
                 "--ffn-hidden-size", str(a["ffn_hidden_size"]), "--num-attention-heads", str(a["num_attention_heads"])]
        if a["group_query_attention"]:
            flags += ["--group-query-attention", "--num-query-groups", str(a["num_query_groups"])]
        flags += ["--kv-channels", str(a["kv_channels"]), "--normalization", "RMSNorm",
                  "--norm-epsilon", repr(a["layernorm_epsilon"]), "--qk-layernorm", "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
                  "--rotary-base", str(a["rotary_base"])]
        if a["use_rope_scaling"]:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(a["rope_scaling_factor"])]
        flags += ["--max-position-embeddings", str(a["max_position_embeddings"]),
                  "--apertus-embedding-rows", str(a["padded_vocab_size"])]
        return flags

    @classmethod
    def from_megatron_args(cls, args: Any, head_rows: int | None = None) -> ModelShape:
        """From Megatron arguments (a namespace or mapping); ``head_rows`` is the released head's row count."""
        get = args.get if isinstance(args, Mapping) else (lambda k, d=None: getattr(args, k, d))
        for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size"):
            if get(k) is None:
                raise ConversionError(f"the Megatron arguments have no {k}")
        heads = int(get("num_attention_heads"))
        groups = int(get("num_query_groups") or heads) if get("group_query_attention", False) else heads
        hidden = int(get("hidden_size"))
        if get("swiglu", False) or get("add_bias_linear", False) or get("normalization", "RMSNorm") != "RMSNorm":
            raise ConversionError("the Megatron model is not an Apertus decoder (needs RMSNorm, no biases, no SwiGLU)")
        rows = int(get("padded_vocab_size"))
        return cls(num_layers=int(get("num_layers")), hidden_size=hidden,
                   ffn_hidden_size=int(get("ffn_hidden_size") or 4 * hidden), num_attention_heads=heads,
                   num_query_groups=groups, kv_channels=int(get("kv_channels") or hidden // heads),
                   embedding_rows=rows, head_rows=int(head_rows or rows),
                   norm_epsilon=float(get("layernorm_epsilon") or get("norm_epsilon") or 1e-5),
                   max_position_embeddings=int(get("max_position_embeddings") or 4096),
                   rope=RopeScaling.from_megatron(args))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelShape:
        d = dict(data)
        d["rope"] = RopeScaling(**d["rope"])
        return cls(**d)


def hf_config_from_shape(shape: ModelShape, template: Mapping[str, Any]) -> dict[str, Any]:
    """A released config (``template``, e.g. the one the checkpoint was imported from) with the text
    model's dimensions, vocabulary rows and RoPE taken from ``shape``.

    The RoPE is written in the template's own style (``rope_parameters``, or ``rope_theta`` +
    ``rope_scaling``); fields of the template that Megatron does not hold are kept.
    """
    cfg = copy.deepcopy(dict(template))
    if cfg.get("model_type") != "apertus1p5" or "text_config" not in cfg:
        raise ConversionError("the config template is not an Apertus 1.5 config (model_type apertus1p5 with a "
                              "text_config); pass the released config.json as the reference")
    text = cfg["text_config"]
    if shape.kv_channels * shape.num_attention_heads != shape.hidden_size and "head_dim" not in text:
        raise ConversionError(f"kv_channels {shape.kv_channels} x {shape.num_attention_heads} heads != hidden size "
                              f"{shape.hidden_size}, and the config has no head_dim")
    text.update(num_hidden_layers=shape.num_layers, hidden_size=shape.hidden_size,
                intermediate_size=shape.ffn_hidden_size, num_attention_heads=shape.num_attention_heads,
                num_key_value_heads=shape.num_query_groups, rms_norm_eps=shape.norm_epsilon,
                max_position_embeddings=shape.max_position_embeddings, vocab_size=shape.embedding_rows,
                output_vocab_size=None if shape.head_rows == shape.embedding_rows else shape.head_rows)
    if "head_dim" in text:
        text["head_dim"] = shape.kv_channels
    if "rope_parameters" in text or "rope_theta" not in text:
        text["rope_parameters"] = shape.rope.hf_parameters()
    else:
        text["rope_theta"] = shape.rope.theta
        params = shape.rope.hf_parameters()
        params.pop("rope_theta")
        text["rope_scaling"] = None if shape.rope.rope_type == "default" else params
    return cfg


# ---------------------------------------------------------------------------------------- tensors
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """Megatron's interleaved ``linear_qkv`` weight from the three projections (rows grouped by query group)."""
    groups = num_query_groups
    hidden = q.shape[-1]
    if k.shape != v.shape or k.shape[0] % groups or q.shape[0] % groups:
        raise ConversionError(f"q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not split "
                              f"into {groups} query groups")
    return torch.cat([q.reshape(groups, -1, hidden), k.reshape(groups, -1, hidden), v.reshape(groups, -1, hidden)],
                     dim=1).reshape(-1, hidden).contiguous()


def split_qkv(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``(q, k, v)`` projection weights."""
    per_group = num_attention_heads // num_query_groups
    hidden = qkv.shape[-1]
    want = num_query_groups * (per_group + 2) * head_dim
    if qkv.shape[0] != want:
        raise ConversionError(f"linear_qkv has {qkv.shape[0]} rows; {num_attention_heads} heads in "
                              f"{num_query_groups} groups of head_dim {head_dim} need {want}")
    g = qkv.reshape(num_query_groups, (per_group + 2) * head_dim, hidden)
    q, k, v = torch.split(g, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, hidden).contiguous(), k.reshape(-1, hidden).contiguous(),
            v.reshape(-1, hidden).contiguous())


def new_rows(existing: torch.Tensor, count: int, *, scale: float = NEW_ROW_SCALE,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """``count`` random rows whose norms are ``scale`` times the mean row norm of ``existing``."""
    if existing.ndim != 2 or existing.shape[0] == 0:
        raise ConversionError(f"new rows need a non-empty 2-D matrix, got shape {tuple(existing.shape)}")
    target = scale * float(existing.float().norm(dim=1).mean())
    rows = torch.randn(count, existing.shape[1], generator=generator, dtype=torch.float32)
    rows = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12) * target
    return rows.to(existing.dtype)


def extend_rows(weight: torch.Tensor, total_rows: int, *, scale: float = NEW_ROW_SCALE,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``weight`` with new rows appended (:func:`new_rows`) up to ``total_rows``; the old rows keep their values."""
    n = weight.shape[0]
    if total_rows < n:
        raise ConversionError(f"cannot extend {n} rows to {total_rows}")
    if total_rows == n:
        return weight
    return torch.cat([weight, new_rows(weight, total_rows - n, scale=scale, generator=generator)], dim=0)


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
#: per-layer suffix (transformers) -> per-layer suffix (Megatron), for the tensors that map one to one
_LAYER_MAP = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "attention_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "feedforward_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.up_proj.weight": "mlp.linear_fc1.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.act_fn.alpha_p": "mlp.activation_func.alpha_p",
    "mlp.act_fn.alpha_n": "mlp.activation_func.alpha_n",
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_XIELU_CONSTANTS = {"mlp.act_fn.beta": _xielu.BETA, "mlp.act_fn.eps": _xielu.EPS}
_TOP_MAP = {"embed_tokens.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight"}


def name_pairs(layer: str = "*") -> list[tuple[str, str]]:
    """``(released name, Megatron name)`` of every tensor that maps one to one (the embedding, the
    final norm, and per layer the tensors of ``_LAYER_MAP``), the layer index written as ``layer``
    (``"*"``: the wildcard patterns a name-pattern registry such as Megatron-Bridge's takes).

    The fused QKV (:data:`QKV_NAMES`, :func:`fuse_qkv`), the LM head (:data:`LM_HEAD`, re-grown and
    pruned) and the xIELU constants are not one to one and are not listed.
    """
    pairs = [(HF_PREFIX_15 + hf, meg) for hf, meg in _TOP_MAP.items()]
    pairs += [(f"{HF_PREFIX_15}layers.{layer}.{hf}", f"decoder.layers.{layer}.{meg}") for hf, meg in _LAYER_MAP.items()]
    return pairs


def qkv_names(layer: str = "*") -> tuple[tuple[str, str, str], str]:
    """``((q, k, v) released names, fused Megatron name)`` of one layer (``"*"``: the wildcard patterns)."""
    lp = f"{HF_PREFIX_15}layers.{layer}."
    return (lp + _QKV[0], lp + _QKV[1], lp + _QKV[2]), f"decoder.layers.{layer}.self_attention.linear_qkv.weight"


def check_xielu_constant(name: str, t: torch.Tensor) -> bool:
    """Whether ``name`` is a saved xIELU constant (``mlp.act_fn.beta``/``eps``); raises if its value is not SPEC's."""
    suffix = next((s for s in _XIELU_CONSTANTS if name.endswith("." + s)), None)
    if suffix is None:
        return False
    want = torch.tensor(_XIELU_CONSTANTS[suffix], dtype=t.dtype)
    if t.numel() != 1 or not torch.equal(t.reshape(()), want):
        raise ConversionError(f"{name} is {t.reshape(-1)[:1].tolist()}, but the Megatron xIELU uses the "
                              f"constant {_XIELU_CONSTANTS[suffix]}")
    return True


def megatron_names(num_layers: int) -> list[str]:
    """Every tensor name of a Megatron Apertus decoder (the names :func:`hf_to_megatron` produces)."""
    names = list(_TOP_MAP.values()) + ["output_layer.weight"]
    for n in range(num_layers):
        names.append(f"decoder.layers.{n}.self_attention.linear_qkv.weight")
        names += [f"decoder.layers.{n}.{m}" for m in _LAYER_MAP.values()]
    return names


@dataclass
class ConvertedWeights:
    """Megatron tensors plus what the Megatron model does not hold (kept to write back unchanged)."""

    tensors: dict[str, torch.Tensor]
    passthrough: dict[str, torch.Tensor]
    shape: ModelShape


def _detect_prefix(names: Any) -> str:
    if any(n.startswith(HF_PREFIX_15) for n in names):
        return HF_PREFIX_15
    if any(n.startswith(HF_PREFIX_10 + "layers.") for n in names):
        return HF_PREFIX_10
    raise ConversionError(f"no language-model tensors under {HF_PREFIX_15!r} or {HF_PREFIX_10!r}")


def hf_to_megatron(state: Mapping[str, torch.Tensor], shape: ModelShape, *, embedding_rows: int | None = None,
                   seed: int = 1234) -> ConvertedWeights:
    """Map a released checkpoint (1.5, or 1.0 under ``model.``) to Megatron tensors.

    Args:
        state: the checkpoint's tensors by name.
        shape: its dimensions (:meth:`ModelShape.from_hf_config`).
        embedding_rows: grow the embedding and the head to this many rows (the 1.0 -> 1.5 vocabulary
            extension); default: the checkpoint's embedding rows.
        seed: seed of the new rows (the re-grown head rows, the extension rows).

    Every tensor of the language model must map; anything else is passed through.
    """
    prefix = _detect_prefix(state)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    passthrough: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = {}
    head = None
    for name, t in state.items():
        if name == LM_HEAD:
            head = t
            continue
        if name.startswith(PASSTHROUGH_PREFIXES):
            passthrough[name] = t
            continue
        if not name.startswith(prefix):
            raise ConversionError(f"{name}: neither a language-model tensor nor under {PASSTHROUGH_PREFIXES}")
        rest = name[len(prefix):]
        if rest in _TOP_MAP:
            out[_TOP_MAP[rest]] = t
            continue
        m = _LAYER.match(rest)
        if m is None:
            raise ConversionError(f"{name}: not a tensor of the Apertus decoder")
        n, suffix = int(m.group(1)), m.group(2)
        if not 0 <= n < shape.num_layers:
            raise ConversionError(f"{name}: layer {n} outside the {shape.num_layers} layers of the config")
        if suffix in _LAYER_MAP:
            out[f"decoder.layers.{n}.{_LAYER_MAP[suffix]}"] = t
        elif suffix in _QKV:
            qkv.setdefault(n, {})[suffix] = t
        elif suffix in _XIELU_CONSTANTS:
            check_xielu_constant(name, t)
            passthrough[name] = t
        else:
            raise ConversionError(f"{name}: not a tensor of the Apertus decoder")
    for n in range(shape.num_layers):
        parts = qkv.get(n, {})
        if len(parts) != 3:
            raise ConversionError(f"layer {n}: q/k/v projections missing ({sorted(parts)})")
        out[f"decoder.layers.{n}.self_attention.linear_qkv.weight"] = fuse_qkv(
            parts[_QKV[0]], parts[_QKV[1]], parts[_QKV[2]], shape.num_query_groups)
    if head is None:
        raise ConversionError("the checkpoint has no lm_head.weight (Apertus keeps untied embeddings)")
    emb = out.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError(f"the checkpoint has no {prefix}embed_tokens.weight")
    if emb.shape[0] != shape.embedding_rows or head.shape[0] != shape.head_rows:
        raise ConversionError(f"embedding/head have {emb.shape[0]}/{head.shape[0]} rows; the config says "
                              f"{shape.embedding_rows}/{shape.head_rows}")
    rows = embedding_rows or shape.embedding_rows
    out["embedding.word_embeddings.weight"] = extend_rows(emb, rows, generator=gen)
    out["output_layer.weight"] = extend_rows(head, rows, generator=gen)
    missing = sorted(set(megatron_names(shape.num_layers)) - set(out))
    if missing:
        raise ConversionError(f"the checkpoint lacks tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return ConvertedWeights(out, passthrough, dataclasses.replace(shape, embedding_rows=rows))


def megatron_to_hf(tensors: Mapping[str, torch.Tensor], shape: ModelShape,
                   passthrough: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Map Megatron tensors back to the released 1.5 layout (head pruned to ``shape.head_rows``).

    ``passthrough`` (the vision and audio tokenizers, the xIELU constants) is added unchanged; xIELU
    constants it lacks are written with SPEC's values in the dtype of ``alpha_p``.
    """
    expected = set(megatron_names(shape.num_layers))
    unknown = sorted(set(tensors) - expected)
    missing = sorted(expected - set(tensors))
    if unknown or missing:
        raise ConversionError(f"Megatron tensors do not match an Apertus decoder of {shape.num_layers} layers: "
                              f"unknown {unknown[:5]}, missing {missing[:5]}")
    inv_layer = {v: k for k, v in _LAYER_MAP.items()}
    inv_top = {v: k for k, v in _TOP_MAP.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in inv_top:
            out[HF_PREFIX_15 + inv_top[name]] = t
        elif name == "output_layer.weight":
            if t.shape[0] < shape.head_rows:
                raise ConversionError(f"output_layer has {t.shape[0]} rows, fewer than the head's {shape.head_rows}")
            out[LM_HEAD] = t[: shape.head_rows].contiguous() if t.shape[0] != shape.head_rows else t
        else:
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
            assert m is not None  # every expected name is a layer name or a top-level one
            n, suffix = int(m.group(1)), m.group(2)
            lp = f"{HF_PREFIX_15}layers.{n}."
            if suffix == "self_attention.linear_qkv.weight":
                q, k, v = split_qkv(t, shape.num_attention_heads, shape.num_query_groups, shape.kv_channels)
                out[lp + _QKV[0]], out[lp + _QKV[1]], out[lp + _QKV[2]] = q, k, v
            else:
                out[lp + inv_layer[suffix]] = t
    renamed = {}
    for name, t in (passthrough or {}).items():
        if name.startswith(HF_PREFIX_10 + "layers."):
            name = HF_PREFIX_15 + name[len(HF_PREFIX_10):]  # the xIELU constants of a 1.0 source
        renamed[name] = t
    passthrough = renamed
    for n in range(shape.num_layers):
        lp = f"{HF_PREFIX_15}layers.{n}."
        dtype = out[lp + "mlp.act_fn.alpha_p"].dtype
        for suffix, value in _XIELU_CONSTANTS.items():
            if lp + suffix not in passthrough:
                out[lp + suffix] = torch.tensor(value, dtype=dtype)
    for name, t in passthrough.items():
        if name in out:
            raise ConversionError(f"{name}: both mapped and passed through")
        out[name] = t
    return out



# ---------------------------------------------------------------------------------------- files
#: Files of a released checkpoint directory that are not weights and travel with a conversion.
SIDE_FILE_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def read_hf_checkpoint(path: str | Any, *, progress: bool = False
                       ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, bytes]]:
    """Read a released checkpoint directory: ``(tensors, config, side files)``.

    Weights come from ``model.safetensors`` or the shards named by ``model.safetensors.index.json``;
    side files are the other small files (tokenizer, generation and processor configs, templates),
    kept byte for byte. ``progress`` shows a tqdm bar over the shards. ``path`` may be a Hub id
    (``ORG/NAME[@REVISION]``, :mod:`apertus_plugins.infra.hub`).
    """
    import json

    from safetensors.torch import load_file
    from tqdm import tqdm

    from apertus_plugins.infra.hub import local_path

    root = local_path(path, weights=True, what="checkpoint")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise ConversionError(f"{root}: no config.json (not a transformers checkpoint directory)")
    config = json.loads(cfg_file.read_text(encoding="utf-8"))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConversionError(f"{root}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc=f"reading {root.name}", unit="shard", disable=not progress):
        if not (root / f).is_file():
            raise ConversionError(f"{root}: shard {f} named by the index is missing")
        for k, v in load_file(str(root / f)).items():
            if k in tensors:
                raise ConversionError(f"{root}: tensor {k} appears in two shards")
            tensors[k] = v
    side: dict[str, bytes] = {}
    for pattern in SIDE_FILE_PATTERNS:
        for f in sorted(root.glob(pattern)):
            if f.is_file() and f.name not in _WEIGHT_FILES and f.name != "config.json":
                side[f.name] = f.read_bytes()
    return tensors, config, side


def replace_dir(tmp: Any, final: Any) -> None:
    """Move the finished directory ``tmp`` to ``final``, replacing an older ``final`` only at the end."""
    import os
    import shutil
    from pathlib import Path

    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old)


def write_hf_checkpoint(path: str | Any, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                        side_files: Mapping[str, bytes] | None = None, *, max_shard_bytes: int = 5 << 30,
                        progress: bool = False) -> None:
    """Write a transformers checkpoint directory (config, side files, safetensors shards with an index).

    Everything is written into a temporary sibling directory that replaces ``path`` at the end, so
    a crash leaves the old directory (or none), never a partial one. ``config.json`` is written as
    transformers writes it (sorted keys, two-space indent, final newline). ``progress`` shows a
    tqdm bar over the bytes written.
    """
    import json
    import os
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file
    from tqdm import tqdm

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    root = final.with_name(f".{final.name}.tmp{os.getpid()}")
    if root.exists():
        shutil.rmtree(root)
    root.mkdir()
    try:
        for name, data in (side_files or {}).items():
            (root / name).write_bytes(data)
        shards: list[list[str]] = [[]]
        size = 0
        for n in sorted(tensors):
            nbytes = tensors[n].numel() * tensors[n].element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(n)
            size += nbytes
        if len(shards) == 1:
            files = {"model.safetensors": shards[0]}
        else:
            files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
        total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with tqdm(total=total_bytes, desc=f"writing {final.name}", unit="B", unit_scale=True,
                  disable=not progress) as bar:
            for fname, keys in files.items():
                save_file({k: tensors[k].contiguous() for k in keys}, str(root / fname), metadata={"format": "pt"})
                bar.update(sum(tensors[k].numel() * tensors[k].element_size() for k in keys))
        if len(files) > 1:
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: fname for fname, keys in files.items() for k in keys}}
            (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (root / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        replace_dir(root, final)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
