"""What every step of a run shares in one process: the run's settings, and (loaded on first use)
the tokenizer, the modality registry, the output streams and the media encoders."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from .. import storage
from ..config import TokenizeConfig
from ..plan import Layout

__all__ = ["RunContext"]


class RunContext:
    """The run of a work directory as a worker process sees it (``config.json``, written by the driver)."""

    def __init__(self, work: str) -> None:
        self.layout = Layout(work)
        self.cfg = TokenizeConfig(**storage.read_json(self.layout.config))
        self.media = self.cfg.media_settings()

    @cached_property
    def chat(self) -> Any:
        """The run's tokenizer with the installed modalities (a plugin's parts and markers)."""
        from apertus_plugins.core.chat import ChatTokenizer
        from apertus_plugins.plugins import spec_from_tokenizer_dir

        return ChatTokenizer(self.cfg.tokenizer, spec_from_tokenizer_dir(self.cfg.tokenizer))

    @property
    def spec(self) -> Any:
        return self.chat.spec

    @cached_property
    def registry(self) -> Any:
        from apertus_plugins.plugins import registry

        return registry()

    @cached_property
    def encoders(self) -> Any:
        """The checkpoint's media encoders (each loaded on its first batch), with the media-code cache."""
        from apertus_plugins.encoders.cache import MediaCodeCache

        from ..encode import MediaEncoders

        cache = MediaCodeCache.resolve(self.cfg.media_cache or "0", self.cfg.media_cache_size)
        return MediaEncoders(self.cfg.checkpoint, self.cfg.device, self.cfg.precision, self.cfg.batch_size, cache)

    @cached_property
    def streams(self) -> list[Any]:
        return self.cfg.streams()
