"""The checks, what they share (:class:`Context`) and how they are registered (:func:`check`).

A check is a function ``Context -> (status, evidence)`` or ``(status, evidence, details)``; it
may raise, and the runner turns the exception into a failure with the message as evidence. Each
check reads only what its own subject needs, so a checkpoint broken one way fails one check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from apertus_plugins.core.vocab import CODE_TOKEN_FORMATS, VocabSpec

from .checkpoint_files import CheckpointFiles

__all__ = ["GROUPS", "Check", "CHECKS", "Context", "check", "reference_spec", "short"]

#: Groups in run order; ``checksums`` runs with ``--checksums``, ``compare`` with ``--compare``, ``serve`` with
#: ``--serve``.
GROUPS = ("tokenizer", "template", "checksums", "config", "serve", "layout", "compare")

Outcome = tuple[str, str] | tuple[str, str, dict[str, Any]]


@dataclass(frozen=True)
class Check:
    """A registered check: ``id`` is ``GROUP.NAME``; ``title`` says what passing means."""

    id: str
    title: str
    func: Callable[[Context], Outcome]

    @property
    def group(self) -> str:
        return self.id.split(".", 1)[0]


CHECKS: list[Check] = []


def check(check_id: str, title: str) -> Callable[[Callable[[Context], Outcome]], Callable[[Context], Outcome]]:
    """Register a check function under ``check_id`` (``GROUP.NAME``)."""
    group = check_id.split(".", 1)[0]
    if group not in GROUPS:
        raise ValueError(f"check {check_id!r}: unknown group {group!r} (groups: {', '.join(GROUPS)})")

    def wrap(func: Callable[[Context], Outcome]) -> Callable[[Context], Outcome]:
        if any(c.id == check_id for c in CHECKS):
            raise ValueError(f"check {check_id!r} registered twice")
        CHECKS.append(Check(check_id, title, func))
        return func

    return wrap


def short(value: Any, limit: int = 60) -> str:
    """``repr`` of ``value`` cut to ``limit`` characters, for evidence lines."""
    text = value if isinstance(value, str) else repr(value)
    text = repr(text) if isinstance(value, str) else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _count_codes(tok: Any, fmt: str, offset: int) -> int:
    n = 0
    while tok.token_to_id(fmt.format(i=n)) == offset + n:
        n += 1
    return n


def reference_spec(tok: Any) -> tuple[VocabSpec, str]:
    """The layout a tokenizer should have, read from its marker tokens only, and its name.

    A tokenizer whose ``<|img_start|>`` is the released id 131,073 must have the released layout
    (:class:`VocabSpec`'s defaults: 266,440 entries). A smaller one (the test tokenizers) must have
    the scaled layout of the same structure: text ids up to the omni block, 200 omni slots, then
    the image and audio codes as many as the tokenizer holds. ``tokenizer_config.json`` is not
    read, so a wrong ``omnimodal_config`` cannot hide behind itself.
    """
    released = VocabSpec(embedding_rows=None)
    img_start = tok.token_to_id(released.literal("img_start"))
    if img_start is None or img_start - 1 == released.omni_offset:
        return released, f"released layout, {released.size:,} ids"
    omni = img_start - 1
    image_offset = omni + released.omni_size
    n_image = _count_codes(tok, CODE_TOKEN_FORMATS["image"], image_offset)
    n_audio = _count_codes(tok, CODE_TOKEN_FORMATS["audio"], image_offset + n_image)
    if omni <= max(released.chat_ids.values()) or not n_image or not n_audio:
        return released, f"released layout, {released.size:,} ids"
    spec = VocabSpec.scaled(text_size=omni, image_codes=n_image, audio_codes=n_audio)
    return spec, f"scaled test layout: {spec.size:,} ids, {omni:,} of them text"


@dataclass
class Context:
    """What the checks of one run share: the checkpoint, the options, facts computed once."""

    ckpt: CheckpointFiles
    other: CheckpointFiles | None = None
    server: Any = None  # a ServeClient
    datasets: Sequence[str | Path] = ()
    probe_prompts: Sequence[dict[str, Any]] | None = None
    probe_tokens: int = 256
    checksums: Sequence[tuple[str, str]] | None = None  # (file name, md5) of a checksum manifest
    checksums_name: str = ""  # the manifest's file name, for evidence lines

    def __post_init__(self) -> None:
        self.cache: dict[str, Any] = {}

    @cached_property
    def _ref(self) -> tuple[VocabSpec, str]:
        return reference_spec(self.ckpt.tokenizer)

    @property
    def ref(self) -> VocabSpec:
        """The layout the checkpoint's tokenizer must have (see :func:`reference_spec`)."""
        return self._ref[0]

    @property
    def layout_name(self) -> str:
        return self._ref[1]

    @cached_property
    def chat(self) -> Any:
        """The core's injection-safe chat tokenizer on the checkpoint's tokenizer and the reference layout."""
        from apertus_plugins.core.chat import ChatTokenizer

        return ChatTokenizer(self.ckpt.tokenizer, self.ref)

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per run (exceptions are cached too and raised again)."""
        if key not in self.cache:
            try:
                self.cache[key] = (True, compute())
            except Exception as exc:
                self.cache[key] = (False, exc)
        ok, value = self.cache[key]
        if not ok:
            raise value
        return value
