"""A fresh vLLM process as a host would run it, for the registration tests (``test_registration.py``).

``python registration_probe.py CHECKPOINT OTHER`` prints one JSON object, for each case: what the plugin's
:func:`vllm_model.register` registered, and what building a model config does for the Apertus checkpoint
and for another model's. The cases: ``unsupported`` (the installed vLLM reports a version outside the
range), ``plugin`` and ``upstream`` (a stand-in for vLLM's own Apertus 1.5 is in the model registry
before the plugin loads; ``APERTUS_VLLM_MODEL`` is set to the case's name). Each case starts from the
registries as vLLM left them at import (one process: importing vLLM is the slow part).
"""

from __future__ import annotations

import json
import logging
import sys

import vllm


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _build(model: str) -> str:
    from vllm.engine.arg_utils import EngineArgs

    try:
        EngineArgs(model=model, dtype="float32", max_model_len=256).create_engine_config()
    except Exception as exc:  # noqa: BLE001 - what the host sees is the result
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _registries() -> list[dict]:
    """The registries register() writes to (each a dict, restored in place between cases)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.reasoning import ReasoningParserManager
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry
    from vllm.tool_parsers import ToolParserManager

    return [ModelRegistry.models, MODELS_CONFIG_MAP, RENDERER_REGISTRY.renderers, TokenizerRegistry.tokenizers,
            ToolParserManager.lazy_parsers, ToolParserManager.tool_parsers, ReasoningParserManager.lazy_parsers,
            ReasoningParserManager.reasoning_parsers]


def case(mode: str, checkpoint: str, other: str) -> dict:
    import os

    from vllm import ModelRegistry

    seen = _Collect()
    logging.getLogger("vllm").addHandler(seen)
    version = vllm.__version__
    os.environ.pop("APERTUS_VLLM_MODEL", None)
    if mode == "unsupported":
        vllm.__version__ = "0.99.0"  # as after a `pip install -U vllm` past the supported range
    else:  # vLLM's own Apertus 1.5, registered before any plugin loads (a stand-in class)
        os.environ["APERTUS_VLLM_MODEL"] = mode
        ModelRegistry.register_model("Apertus1p5ForConditionalGeneration",
                                     "vllm.model_executor.models.llama:LlamaForCausalLM")
    import vllm_model

    vllm_model._registered = False
    vllm_model.register()
    vllm_model.register()  # vLLM calls it in every process, sometimes twice: still one message
    vllm.__version__ = version
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.reasoning import ReasoningParserManager
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry
    from vllm.tool_parsers import ToolParserManager

    held = ModelRegistry.models.get(vllm_model.ARCHITECTURE)
    report = {
        "choice": vllm_model.model_choice(),
        "refusal": vllm_model.refusal(),
        "model": getattr(held, "module_name", None) or getattr(getattr(held, "model_cls", None), "__module__", None),
        "config_hook": getattr(MODELS_CONFIG_MAP.get(vllm_model.ARCHITECTURE), "__module__", None),
        "renderer_mode": vllm_model.RENDERER_MODE in RENDERER_REGISTRY.renderers,
        "tokenizer_mode": vllm_model.RENDERER_MODE in TokenizerRegistry.tokenizers,
        "tool_parser": ToolParserManager.lazy_parsers.get("apertus", (None,))[0],
        "tool_parser_alias": "apertus_plugins" in ToolParserManager.lazy_parsers,
        "reasoning_parser_alias": "apertus_plugins" in ReasoningParserManager.lazy_parsers,
        "logs": [line for line in seen.lines if "apertus" in line[1].lower()],
        "apertus": _build(checkpoint),
        "other": _build(other),
    }
    logging.getLogger("vllm").removeHandler(seen)
    return report


def main(checkpoint: str, other: str) -> None:
    import vllm_model

    registries = _registries()
    pristine = [dict(r) for r in registries]
    report = {}
    for mode in ("unsupported", "plugin", "upstream"):
        for live, saved in zip(registries, pristine, strict=True):
            live.clear()
            live.update(saved)
        vllm_model._choice = vllm_model._refusal = vllm_model._parser_note = None
        report[mode] = case(mode, checkpoint, other)
    print("PROBE " + json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:3])
