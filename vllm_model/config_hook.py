"""vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``) for ``Apertus1p5ForConditionalGeneration``.

vLLM calls it once its model config is built, in every process. It

- selects the injection-safe chat renderer (tokenizer mode ``apertus``, :mod:`vllm_model.renderer`)
  when ``--tokenizer-mode`` is ``auto``, as vLLM itself does for the models whose chat encoding it
  ships (``deepseek_v32``, ``kimi_k3``); an explicit mode is kept;
- makes generation stop at ``<|assistant_end|>`` and after a complete tool call even when the
  checkpoint's generation config lacks those stops (:mod:`vllm_model.generation`);
- hands the server's image limit (``max_image_pixels``, :data:`vllm_model.processing.SERVER_OPTIONS`)
  to vLLM's own image loader (``VLLM_MAX_IMAGE_PIXELS``, read from the header before decoding, a 400
  above it) and to Pillow (``Image.MAX_IMAGE_PIXELS``), unless the environment sets it already.
"""

from __future__ import annotations

import os
from typing import Any

from . import RENDERER_MODE as MODE
from .generation import complete_stops
from .logs import get_logger

logger = get_logger(__name__)  # under vLLM's `vllm` logger: shown by `vllm serve`

__all__ = ["Apertus1p5ConfigHook", "apply_media_limits", "select_renderer"]


def apply_media_limits(model_config: Any) -> int:
    """The server's largest image (pixels) for vLLM's loader and Pillow; returns it."""
    from PIL import Image

    from .processing import SERVER_OPTIONS

    mm_config = getattr(model_config, "multimodal_config", None)
    options = dict(getattr(mm_config, "mm_processor_kwargs", None) or {})
    limit = int(options.get("max_image_pixels", SERVER_OPTIONS["max_image_pixels"]))
    if "VLLM_MAX_IMAGE_PIXELS" not in os.environ:
        os.environ["VLLM_MAX_IMAGE_PIXELS"] = str(limit)
    else:
        limit = min(limit, int(os.environ["VLLM_MAX_IMAGE_PIXELS"]))
    if Image.MAX_IMAGE_PIXELS is None or Image.MAX_IMAGE_PIXELS > limit:
        Image.MAX_IMAGE_PIXELS = limit  # Pillow warns above it, refuses twice it (a 400 through the renderer)
    return limit


def select_renderer(model_config: Any) -> None:
    """Tokenizer mode ``apertus`` for an ``auto`` mode; an explicit mode stays (``hf``: vLLM's stock path)."""
    if model_config.tokenizer_mode == "auto":
        model_config.tokenizer_mode = MODE
        logger.info("apertus: chat requests rendered by the core (tokenizer mode %r, injection-safe)", MODE)
    elif model_config.tokenizer_mode != MODE:
        logger.warning("apertus: tokenizer mode %r renders chat requests with vLLM's stock path, where user text "
                       "can forge structure tokens; leave --tokenizer-mode at auto (or set %r) for the core's "
                       "injection-safe encoding", model_config.tokenizer_mode, MODE)


class Apertus1p5ConfigHook:
    """The hook vLLM looks up by architecture in ``MODELS_CONFIG_MAP``."""

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        from . import parser_note

        if parser_note():  # said here, where vLLM's logging is configured (register() runs before it)
            logger.info_once(parser_note())
        select_renderer(model_config)
        complete_stops(model_config)
        apply_media_limits(model_config)

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        if vllm_config.model_config is not None:
            Apertus1p5ConfigHook.verify_and_update_model_config(vllm_config.model_config)
