"""The Apertus model in Megatron-LM 0.19's config container: a ``GPTModelConfig`` naming the plugin's builder.

From 0.19 ``pretrain`` builds the model from ``cfg_container.model``: the config's ``builder``
class variable names the ``ModelBuilder`` that ``setup_model_and_optimizer`` instantiates. A config
subclass that changes only the builder is how Megatron-LM itself plugs in other model construction
(``megatron.post_training.model_builder.ModelOptModelConfig``); :class:`ApertusModelConfig` does the
same, and :class:`ApertusModelBuilder` builds each pipeline stage with the plugin's model provider
(:func:`megatron_patches.training.model_provider`: the preflight once, then the Apertus
``GPTModel`` with the container's transformer config). The launcher hands ``pretrain`` a copy of
the script's container with this model config (:mod:`megatron_patches.overrides`).

Megatron-LM 0.19 and later only (``megatron.training.models``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

from .version import require_supported

# the version check follows the imports (import order): an unsupported megatron-core stops here with the
# supported range, before anything of this module is defined or run
require_supported()

__all__ = ["ApertusModelConfig", "ApertusModelBuilder"]


@dataclasses.dataclass(kw_only=True)
class ApertusModelConfig(GPTModelConfig):
    """``GPTModelConfig`` whose builder is :class:`ApertusModelBuilder` (no new fields)."""

    builder: ClassVar[str] = "megatron_patches.model_builder.ApertusModelBuilder"

    @classmethod
    def from_config(cls, config: GPTModelConfig) -> ApertusModelConfig:
        """The same settings as ``config`` (a new object: the script's stays as it was)."""
        if not isinstance(config, GPTModelConfig):
            raise TypeError(f"the config container's model is a {type(config).__name__}, not a GPTModelConfig: "
                            "apertus-megatron trains a GPT model (pretrain_gpt.py)")
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})


class ApertusModelBuilder(GPTModelBuilder):
    """Builds one pipeline stage with :func:`megatron_patches.training.model_provider`."""

    def build_model(self, pg_collection: Any, pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None) -> Any:
        from .training import model_provider

        if pre_process is None:
            pre_process = is_pp_first_stage(pg_collection.pp)
        if post_process is None:
            post_process = is_pp_last_stage(pg_collection.pp)
        return model_provider(pre_process, post_process, vp_stage, config=self._model_config.transformer,
                              pg_collection=pg_collection)
