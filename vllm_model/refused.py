"""The stand-in for ``Apertus1p5ForConditionalGeneration`` where the installed vLLM is outside the supported range.

:func:`vllm_model.register` registers nothing of the plugin's there (vLLM's other models keep serving),
but an Apertus 1.5 checkpoint must not fail with vLLM's generic "architecture not supported": the stand-in
answers to the architecture and refuses with the message :func:`vllm_model.register` logged, as soon as
vLLM builds the model config (:class:`RefusedConfigHook`) and again should the model itself be built.
"""

from __future__ import annotations

from typing import Any

import torch

from apertus_plugins.infra.versions import UnsupportedVersionError

__all__ = ["MESSAGE", "RefusedApertus1p5", "RefusedConfigHook", "refuse"]


#: The message :func:`vllm_model.register` logged (it sets it before registering the stand-in).
MESSAGE = "apertus-plugins does not support the installed vLLM"


def refuse() -> None:
    """Raise the error :func:`vllm_model.register` logged (the supported range and ``VLLM_PLUGINS=``)."""
    raise UnsupportedVersionError(MESSAGE)


class RefusedApertus1p5(torch.nn.Module):
    """Answers to the architecture name; building it raises :class:`vllm_model.UnsupportedVLLMError`
    (:class:`~apertus_plugins.infra.versions.UnsupportedVersionError`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        refuse()

    # what vLLM's registry inspects to accept a text-generation model (so the config hook is reached)
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        refuse()
        raise AssertionError  # unreachable: refuse() raises

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        refuse()
        raise AssertionError

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        refuse()
        raise AssertionError


class RefusedConfigHook:
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``): refuses before any weight is read."""

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        refuse()

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        refuse()
