"""The contract of an ``apertus`` plugin: the hook markers, the hook specifications, :class:`Modality`.

Plugins (the built-in modalities, judges and reward functions, the adapters' contributions, third
parties) import only this module; the plugin manager that collects them is
:mod:`apertus_plugins.plugins`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pluggy

__all__ = ["PROJECT", "hookspec", "hookimpl", "Modality", "ApertusHookSpecs"]

PROJECT = "apertus"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class Modality:
    """What a modality contributes to the token stream.

    Attributes:
        name: the modality's name (``"image"``); also the name of its code block in a VocabSpec.
        codebook_size: the number of content codes in the released layout.
        placeholder: marker name of the prompt placeholder (``"image"`` -> ``<|image|>``).
        markers: marker names (omni-block slots) the modality's sequences use.
        part_types: chat content-part types that carry this modality (``"image_url"``...).
        layouts: the names of the sequence layouts it supports; the first is the serving default.
        build_sequence: ``build_sequence(codes, spec, layout=..., **kw) -> ids``.
        tokenizer_factory: ``factory(checkpoint_dir, **kw) -> encoder`` or ``None`` when the
            modality brings no encoder of its own.
        task_markers: marker names that condition but are never predicted after stage 1.
    """

    name: str
    codebook_size: int
    placeholder: str
    markers: tuple[str, ...]
    part_types: tuple[str, ...]
    layouts: tuple[str, ...]
    build_sequence: Callable[..., Any]
    tokenizer_factory: Callable[..., Any] | None = None
    task_markers: tuple[str, ...] = ()


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
        """Return reward functions: name -> ``reward(response: str, ground_truth, **kw) -> float``."""

    @hookspec
    def apertus_target_rules(self) -> Mapping[str, Callable[..., Any]]:
        """Return loss-target rules: name -> ``rule(ids, labels, weights, spec) -> weights``."""

    @hookspec
    def apertus_commands(self) -> Mapping[str, Callable[..., Any]]:
        """Return ``apertus`` subcommands: name -> ``add_parser(subparsers)``.

        ``add_parser`` registers the subcommand on the argparse sub-parsers and sets ``func`` on
        it, as the core's own command modules do; it must not import heavy dependencies.
        """
