"""The contract of an ``apertus`` plugin: the hook markers, the hook specifications, :class:`Modality`.

Plugins (the built-in modalities, judges and reward functions, the adapters' contributions, third
parties) import only this module; the plugin manager that collects them is
:mod:`apertus_plugins.plugins`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from apertus_plugins.core.vocab import MediaKind

__all__ = ["PROJECT", "hookspec", "hookimpl", "Modality", "ApertusHookSpecs"]

PROJECT = "apertus"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Modality:
    """What a modality contributes to the token stream, and how the core reads its media.

    The registry merges what the core needs of it (:attr:`kind`: part types, placeholder, task
    markers, code block; and its omni :attr:`slots`) into a
    :class:`~apertus_plugins.core.vocab.VocabSpec` (:func:`apertus_plugins.plugins.spec`), which the
    callers above the core hand down: the chat normalizer and template, the chat tokenizer
    (placeholder expansion, role of the codes) and the loss targets take it from there. The offline
    pipeline also uses its probe, load, encoder and sequence builder.

    Attributes:
        name: the modality's name (``"image"``); a media item of a conversation has this kind.
        placeholder: marker name of the prompt placeholder (``"image"`` -> ``<|image|>``); the chat
            template renders it for each of the modality's parts.
        part_types: chat content-part types that carry this modality (``"image_url"``...).
        layouts: the names of the sequence layouts it supports; the first is the serving default.
        build_sequence: ``build_sequence(codes, spec, text_ids=..., layout=...) -> ids``; ``text_ids``
            maps a string to text ids (the chat tokenizer's ``char_ids``); the offline pipeline
            passes the run's image ``layout`` to every modality whose codes are image codes.
        tokenizer_factory: ``factory(checkpoint_dir, device=..., precision=...) -> encoder`` or
            ``None`` when the modality brings no encoder of its own; a plugin's encoder has
            ``encode(arrays, batch_size=...) -> list of code arrays`` (the built-in modalities use
            the core's vision and audio tokenizers).
        task_markers: marker names that condition but are never predicted after stage 1.
        slots: omni-block slots the modality adds to the vocabulary, ``slot -> (marker name,
            literal)``; the built-in modalities' slots are the released layout
            (:data:`apertus_plugins.core.vocab.OMNI_SLOTS`) and add none.
        code_block: the VocabSpec code block its content codes are in (default: ``name``); the
            codes' loss role is that block's (a video of image codes trains as image codes).
        probe: ``probe(data: bytes) -> (shape, number of codes)`` of one raw item, read cheaply
            (the offline planner's batching by shape); raise ``ValueError`` for unreadable input.
        load: ``load(data: bytes) -> array`` the preprocessed item the encoder takes; raise
            ``ValueError`` for unreadable input.
    """

    name: str
    placeholder: str
    part_types: tuple[str, ...]
    layouts: tuple[str, ...]
    build_sequence: Callable[..., Any]
    tokenizer_factory: Callable[..., Any] | None = None
    task_markers: tuple[str, ...] = ()
    slots: Mapping[int, tuple[str, str]] = field(default_factory=dict)
    code_block: str | None = None
    probe: Callable[[bytes], tuple[Any, int]] | None = None
    load: Callable[[bytes], Any] | None = None

    @property
    def codes_in(self) -> str:
        """The code block of its content codes."""
        return self.code_block or self.name

    @property
    def kind(self) -> MediaKind:
        """What the core knows of it: the data a :class:`~apertus_plugins.core.vocab.VocabSpec` carries."""
        return MediaKind(self.name, self.placeholder, tuple(self.part_types), tuple(self.task_markers), self.code_block)

    @classmethod
    def of(cls, kind: MediaKind, **rest: Any) -> Modality:
        """A modality over a kind the core states (the built-in ones: :data:`~apertus_plugins.core.vocab.BUILTIN_MEDIA`)."""
        return cls(name=kind.name, placeholder=kind.placeholder, part_types=kind.part_types,
                   task_markers=kind.task_markers, code_block=kind.code_block, **rest)


class ApertusHookSpecs:
    """The hook specifications: the documented contract of an ``apertus`` plugin.

    Every hook returns a list (or mapping) of contributions; pluggy collects the results of
    all plugins. Names must be unique across plugins: a clash is an error naming both.
    """

    @hookspec
    def apertus_modalities(self) -> list[Modality]:
        """Return the modalities this plugin provides."""

    @hookspec
    def apertus_judges(self) -> Mapping[str, Callable[..., Any]]:
        """Return judge backends: name -> ``factory(**config) -> judge``."""

    @hookspec
    def apertus_reward_functions(self) -> Mapping[str, Callable[..., Any]]:
        """Return reward functions: name -> ``reward(response: str, ground_truth, **kw)`` returning the reward as a
        float, or a mapping ``{"score": float, ...}`` whose other keys are extra information (the ``code`` reward's
        verdicts)."""

    @hookspec
    def apertus_commands(self) -> Mapping[str, Callable[..., Any]]:
        """Return ``apertus`` subcommands: name -> ``add_parser(subparsers)``.

        ``add_parser`` registers the subcommand on the argparse sub-parsers and sets ``func`` on
        it, as the core's own command modules do; it must not import heavy dependencies.
        """
