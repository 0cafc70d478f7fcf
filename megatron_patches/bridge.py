"""Apertus 1.5 in Megatron-Bridge: a registered model bridge and model provider (``megatron-bridge`` 0.6.x).

Importing this module registers :class:`Apertus1p5Bridge` with Megatron-Bridge's model-bridge
registry (``MegatronModelBridge.register_bridge``, the decorator its built-in models use) for the
architecture ``Apertus1p5ForConditionalGeneration``, and the ``apertus1p5`` configs with
``transformers`` where it lacks them. Megatron-Bridge 0.6.2 has no entry point for third-party
bridges, so this is the one import a user (or verl, through ``actor_rollout_ref.model.external_lib``)
makes; then ``AutoBridge.from_hf_pretrained(released checkpoint)`` works as for a built-in model.

Nothing here is a second copy of the conversion:

* the provider's shape, RoPE and vocabulary rows come from
  :class:`megatron_patches.convert.ModelShape` (which refuses a non-Apertus config, naming the field),
  its layer spec is :func:`megatron_patches.spec.apertus_layer_spec` (xIELU MLP, QK-norm, no biases);
* the weight mappings are built from :func:`megatron_patches.convert.name_pairs` and
  :func:`~megatron_patches.convert.qkv_names`; the fused QKV is :func:`~megatron_patches.convert.fuse_qkv`
  / :func:`~megatron_patches.convert.split_qkv`, the text head is re-grown with
  :func:`~megatron_patches.convert.extend_rows` (seed 1234, the rows ``apertus convert to-megatron``
  writes) and pruned back to ``output_vocab_size`` on export; Megatron-Bridge's own mapping classes
  only shard them over tensor-parallel ranks.

The media tokenizers (``model.vision_tokenizer.*``, ``model.audio_tokenizer.*``) and the saved xIELU
constants are not part of the Megatron model (frozen and outside it, as in the report); export
hands them back unchanged, so ``export_hf_weights`` yields every tensor of the released checkpoint.

A checkpoint whose vocabulary layout differs from its tokenizer's (or, without a tokenizer, from
the released layout) is refused with :class:`~megatron_patches.convert.ConversionError` naming the
config field. The layer spec is Transformer Engine's when it is importable and a GPU is present,
else megatron-core's local modules (set ``transformer_layer_spec`` on the provider to choose).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any

import torch
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import (
    HFWeightTuple,
    MegatronModelBridge,
    register_bridge_implementation,
)
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    ColumnParallelMapping,
    QKVMapping,
)
from megatron.bridge.models.conversion.utils import remove_non_pickleables
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from apertus_plugins.core.tensor_names import ENCODER_PREFIXES, LM_HEAD, is_text_tensor
from apertus_plugins.core.vocab import VocabSpec, default_spec
from apertus_plugins.infra.versions import require

from .convert import (
    ConversionError,
    ModelShape,
    check_xielu_constant,
    extend_rows,
    fuse_qkv,
    name_pairs,
    qkv_names,
    split_qkv,
)
from .spec import apertus_layer_spec, check_apertus_config, checkpoint_to_local_name
from .version import require_supported

# the version checks follow the imports (import order): an unsupported megatron-core or Megatron-Bridge stops here
require_supported()
require("megatron-bridge", _dist_version("megatron-bridge"))  # installed: the imports above worked

__all__ = ["ARCHITECTURE", "HEAD_SEED", "Apertus1p5Bridge", "ApertusModelProvider", "check_vocab_layout"]

#: The released checkpoint's architecture (``config.json`` ``architectures``).
ARCHITECTURE = "Apertus1p5ForConditionalGeneration"
#: Seed of the head rows beyond ``output_vocab_size`` (``convert.hf_to_megatron``'s default).
HEAD_SEED = 1234


def _register_transformers() -> None:
    from apertus_plugins.hf.modeling import register

    register()


_register_transformers()


# ------------------------------------------------------------------------------------- the provider
def _use_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries
        return False
    return torch.cuda.is_available()


def apertus_provider_layer_spec(config: GPTModelProvider) -> ModuleSpec:
    """The provider's default ``transformer_layer_spec``: the Apertus layer (Transformer Engine on a GPU
    where it is installed, else megatron-core's local modules)."""
    check_apertus_config(config)
    return apertus_layer_spec(use_transformer_engine=_use_transformer_engine())


@dataclass
class ApertusModelProvider(GPTModelProvider):
    """``GPTModelProvider`` with the Apertus defaults: the Apertus layer spec, untied embeddings, RoPE, no
    biases, a non-gated MLP without bias-activation fusion (xIELU is not fusable), RMSNorm and QK-norm.

    ``head_rows`` is the released head's row count (``output_vocab_size``: the text ids); the Megatron
    output layer has one row per embedding row, and the rows beyond ``head_rows`` never reach a released
    checkpoint.
    """

    transformer_layer_spec: ModuleSpec | Callable[[GPTModelProvider], ModuleSpec] = apertus_provider_layer_spec
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "rope"
    normalization: str = "RMSNorm"
    qk_layernorm: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    bias_activation_fusion: bool = False
    head_rows: int | None = None


# ------------------------------------------------------------------------------------- vocabulary
def check_vocab_layout(config: Mapping[str, Any], checkpoint: str | Path | None = None) -> VocabSpec:
    """The vocabulary layout ``config`` (a released ``config.json`` as a dict) must have; raises
    :class:`ConversionError` naming the first field that differs.

    The layout is the tokenizer's in ``checkpoint`` (``tokenizer.json`` + ``tokenizer_config.json``)
    when it has one, else the released layout (SPEC.md section 1). The head must cover exactly the
    text ids (``text_config.output_vocab_size``), the code blocks must start at the tokenizer's offsets
    with its codebook sizes, the placeholders must be its ids and the embedding must hold every id.
    """
    root = Path(checkpoint) if checkpoint is not None else None
    has_tokenizer = root is not None and (root / "tokenizer_config.json").is_file() \
        and (root / "tokenizer.json").is_file()
    spec = VocabSpec.from_tokenizer_dir(root) if has_tokenizer else default_spec()
    source = f"the tokenizer in {root}" if has_tokenizer else "the released layout"
    text = config.get("text_config") or {}
    rows = int(text.get("vocab_size") or 0)
    want: list[tuple[str, Any, Any]] = [
        ("text_config.output_vocab_size", text.get("output_vocab_size"), spec.text_size),
        ("image_token_offset", config.get("image_token_offset"), spec.modality("image").offset),
        ("audio_token_offset", config.get("audio_token_offset"), spec.modality("audio").offset),
        ("vision_config.codebook_size", (config.get("vision_config") or {}).get("codebook_size"),
         spec.modality("image").size),
        ("audio_config.codebook_size", (config.get("audio_config") or {}).get("codebook_size"),
         spec.modality("audio").size),
        ("image_token_id", config.get("image_token_id"), spec.id("image")),
        ("audio_token_id", config.get("audio_token_id"), spec.id("audio")),
    ]
    for field_name, have, expected in want:
        if have is None or int(have) != int(expected):
            raise ConversionError(f"{root or 'the checkpoint'}: config.json {field_name} is {have}, but {source} "
                                  f"has {expected}: the vocabulary layout differs, refusing to bridge it")
    if rows < spec.size:
        raise ConversionError(f"{root or 'the checkpoint'}: config.json text_config.vocab_size is {rows}, but "
                              f"{source} needs {spec.size} embedding rows (ids 0..{spec.size - 1})")
    return spec


# ------------------------------------------------------------------------------------- mappings
class ApertusQKVMapping(QKVMapping):
    """The fused ``linear_qkv`` through :func:`~megatron_patches.convert.fuse_qkv` / ``split_qkv``;
    Megatron-Bridge's tensor-parallel mapping shards and gathers the fused tensor."""

    def hf_to_megatron(self, hf_weights: dict[str, torch.Tensor], megatron_module: torch.nn.Module) -> torch.Tensor:
        merged = None
        if self.tp_rank == 0:
            config = self._get_config(megatron_module)
            merged = fuse_qkv(hf_weights["q"], hf_weights["k"], hf_weights["v"],
                              config.num_query_groups or config.num_attention_heads)
        return self._tp_mapping.hf_to_megatron(merged, megatron_module)

    def megatron_to_hf(self, megatron_weights: torch.Tensor | None,
                       megatron_module: torch.nn.Module | None) -> dict[str, torch.Tensor]:
        if megatron_weights is not None:
            megatron_weights = self.maybe_dequantize(megatron_weights)
        if megatron_module is None:  # every pipeline rank takes part in the broadcast
            config = self.broadcast_obj_from_pp_rank(None, "qkv_config")
        else:
            config = remove_non_pickleables(self._get_config(megatron_module), max_depth=3)
            config = self.broadcast_obj_from_pp_rank(config, "qkv_config")
        packed = self._tp_mapping.megatron_to_hf(megatron_weights, megatron_module)
        if not packed:
            return {}
        heads = config.num_attention_heads
        q, k, v = split_qkv(next(iter(packed.values())), heads, config.num_query_groups or heads,
                            config.kv_channels or config.hidden_size // heads)
        return {self.hf_param["q"]: q, self.hf_param["k"]: k, self.hf_param["v"]: v}


class ApertusHeadMapping(ColumnParallelMapping):
    """``lm_head.weight`` (``head_rows`` text rows) <-> ``output_layer.weight`` (one row per embedding row).

    Loading appends :func:`~megatron_patches.convert.extend_rows`'s rows (seeded with :data:`HEAD_SEED`);
    exporting keeps the first ``head_rows`` rows, so the released head comes back bit for bit.
    """

    def __init__(self, megatron_param: str, hf_param: str, head_rows: int) -> None:
        super().__init__(megatron_param, hf_param)
        self.head_rows = head_rows

    def hf_to_megatron(self, hf_weights: torch.Tensor, megatron_module: torch.nn.Module) -> torch.Tensor:
        if self.tp_rank == 0:
            if hf_weights.shape[0] != self.head_rows:
                raise ConversionError(f"{self.hf_param} has {hf_weights.shape[0]} rows; config.json "
                                      f"text_config.output_vocab_size says {self.head_rows}")
            rows = megatron_module.weight.shape[0] * self.tp_size
            hf_weights = extend_rows(hf_weights, rows, generator=torch.Generator().manual_seed(HEAD_SEED))
        return super().hf_to_megatron(hf_weights, megatron_module)

    def megatron_to_hf(self, megatron_weights: torch.Tensor | None,
                       megatron_module: torch.nn.Module | None) -> dict[str, torch.Tensor]:
        out = super().megatron_to_hf(megatron_weights, megatron_module)
        return {k: v[: self.head_rows].contiguous() for k, v in out.items()}

    def resolve(self, captures: tuple[str, ...]) -> ApertusHeadMapping:
        return self


def _megatron_variants(name: str) -> list[str]:
    """A checkpoint-style Megatron name and, where the local layer spec names it differently, that name."""
    local = checkpoint_to_local_name(name, apertus_layer_spec(use_transformer_engine=False))
    return [name] if local == name else [name, local]


# ------------------------------------------------------------------------------------- the bridge
AutoMapping.register_module_type("XIELU", "replicated")


@MegatronModelBridge.register_bridge(source=ARCHITECTURE, target=GPTModel, provider=ApertusModelProvider,
                                     model_type="apertus1p5")
class Apertus1p5Bridge(MegatronModelBridge):
    """Megatron-Bridge's bridge for ``Apertus1p5ForConditionalGeneration`` (the language model; see the module)."""

    def _shape(self, config: Any) -> ModelShape:
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return ModelShape.from_hf_config(cfg)

    def provider_bridge(self, hf_pretrained: Any) -> ApertusModelProvider:
        config = hf_pretrained.config
        cfg = config.to_dict()
        check_vocab_layout(cfg, getattr(hf_pretrained, "model_name_or_path", None))
        shape = ModelShape.from_hf_config(cfg)
        args = shape.megatron_args()
        text = cfg["text_config"]
        dtype = self.dtype_from_hf(config.text_config if hasattr(config, "text_config") else config,
                                   default=torch.float32)
        return ApertusModelProvider(
            num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
            num_attention_heads=args["num_attention_heads"], num_query_groups=args["num_query_groups"],
            kv_channels=args["kv_channels"], layernorm_epsilon=args["layernorm_epsilon"],
            vocab_size=args["padded_vocab_size"], head_rows=shape.head_rows,
            seq_length=args["max_position_embeddings"], rotary_base=args["rotary_base"],
            rotary_percent=args["rotary_percent"], rope_scaling=args["use_rope_scaling"],
            rope_scaling_factor=args["rope_scaling_factor"],
            init_method_std=float(text.get("initializer_range", 0.02)),
            params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            make_vocab_size_divisible_by=1,
        )

    def mapping_registry(self) -> MegatronMappingRegistry:
        if self.hf_config is None:
            raise ConversionError("the Apertus bridge needs the checkpoint's config (AutoBridge sets it)")
        shape = self._shape(self.hf_config)
        mappings: list[Any] = []
        for hf, meg in name_pairs("*"):
            mappings += [AutoMapping(megatron_param=m, hf_param=hf) for m in _megatron_variants(meg)]
        (q, k, v), fused = qkv_names("*")
        mappings.append(ApertusQKVMapping(megatron_param=fused, q=q, k=k, v=v))
        mappings.append(ApertusHeadMapping("output_layer.weight", LM_HEAD, shape.head_rows))
        return MegatronMappingRegistry(*mappings)

    def build_conversion_tasks(self, hf_pretrained: Any, megatron_model: list[Any], weight_dtype: Any = None
                               ) -> list[Any]:
        """Megatron-Bridge's tasks, then strictness it leaves to warnings: every Megatron parameter has
        a task and every language-model tensor of the checkpoint is read (xIELU constants checked)."""
        tasks = super().build_conversion_tasks(hf_pretrained, megatron_model, weight_dtype=weight_dtype)
        unmapped = [n for m in megatron_model for n, _ in m.named_parameters()
                    if not any(t is not None and t.param_name == self._unwrap_name(n) for t in tasks)]
        if unmapped:
            raise ConversionError(f"Megatron parameters without an Apertus mapping: {unmapped[:5]}")
        state = getattr(hf_pretrained, "state", None)
        if state is not None and hasattr(state, "source"):
            read: set[str] = set()
            for t in tasks:
                if t is not None:
                    hf = t.mapping.hf_param
                    read.update([hf] if isinstance(hf, str) else hf.values())
            unread = [n for n in state.source.get_all_keys() if is_text_tensor(n) and n not in read
                      and not check_xielu_constant(n, state[n])]
            if unread:
                raise ConversionError(f"checkpoint tensors the Apertus bridge does not map: {sorted(unread)[:5]}")
        return tasks

    def stream_weights_megatron_to_hf(self, megatron_model: Any, hf_pretrained: Any, cpu: bool = True,
                                      show_progress: bool = True, conversion_tasks: Any = None,
                                      merge_adapter_weights: bool = True, weight_dtype: Any = None
                                      ) -> Iterable[HFWeightTuple]:
        """Megatron-Bridge's export of the language model, then the tensors outside it (the media
        tokenizers and the saved xIELU constants) unchanged from the source checkpoint."""
        yield from super().stream_weights_megatron_to_hf(
            megatron_model, hf_pretrained, cpu=cpu, show_progress=show_progress, conversion_tasks=conversion_tasks,
            merge_adapter_weights=merge_adapter_weights, weight_dtype=weight_dtype)
        state = getattr(hf_pretrained, "state", None)
        if state is None or not hasattr(state, "source"):
            return
        for name in state.source.get_all_keys():
            if name.startswith(ENCODER_PREFIXES) or (is_text_tensor(name) and check_xielu_constant(name, state[name])):
                yield HFWeightTuple(name, state[name])


def _register_transformers_class() -> None:
    """Also dispatch on the ``transformers`` class where the installed version has the released port
    (``AutoBridge`` looks an architecture up by class when ``transformers`` has it)."""
    import transformers

    cls = getattr(transformers, ARCHITECTURE, None)
    if cls is not None:
        register_bridge_implementation(source=cls, target=GPTModel, bridge_class=Apertus1p5Bridge)


_register_transformers_class()
