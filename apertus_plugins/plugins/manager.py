"""The plugin manager (project name ``apertus``) and the registry of what the loaded plugins contribute.

A third party adds a modality, a judge backend, a reward function or an ``apertus`` subcommand without
touching this repository: it ships a module with ``@hookimpl`` functions and names it in the
``apertus`` entry-point group of its distribution::

    [project.entry-points.apertus]
    video = "my_pkg.apertus_video"

The built-in image and audio modalities register through the same hooks
(:mod:`apertus_plugins.plugins.builtin`), so a new modality takes the path the built-in ones take, and
every adapter that consults :func:`registry` sees it. The hook markers and specifications live in
:mod:`apertus_plugins.plugins.hooks`: plugins import that module (or :mod:`apertus_plugins.plugins`, which
re-exports it), the manager collects them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import pluggy

from apertus_plugins.core.vocab import VocabSpec, default_spec

from .hooks import PROJECT, ApertusHookSpecs, Modality, hookimpl, hookspec

__all__ = ["PROJECT", "hookspec", "hookimpl", "Modality", "ApertusHookSpecs", "Registry", "get_plugin_manager",
           "make_judge", "registry", "serving_layout", "spec", "spec_from_tokenizer_dir"]

@dataclass
class Registry:
    """Everything the loaded plugins contribute, by name."""

    modalities: dict[str, Modality] = field(default_factory=dict)
    judges: dict[str, Callable[..., Any]] = field(default_factory=dict)
    reward_functions: dict[str, Callable[..., Any]] = field(default_factory=dict)
    commands: dict[str, Callable[..., Any]] = field(default_factory=dict)
    plugins: dict[str, str] = field(default_factory=dict)

    def modality_for_part(self, part_type: str) -> Modality | None:
        """The modality whose chat parts have type ``part_type``, if any."""
        for m in self.modalities.values():
            if part_type in m.part_types:
                return m
        return None

    def spec(self, base: VocabSpec | None = None) -> VocabSpec:
        """``base`` (default: the released layout) with every registered modality: its kind and its omni slots.

        The one place the plugins' modalities join the id layout; the core below takes the result as
        any other :class:`VocabSpec` (a slot claimed twice, or under a used name, is a ``VocabError``
        naming the modality).
        """
        slots, owner = self._slots()
        return (base or default_spec()).extended([m.kind for m in self.modalities.values()], slots, owner)

    def spec_from_tokenizer_dir(self, path: str | Path, embedding_rows: int | None = None) -> VocabSpec:
        """The layout of a tokenizer directory with the registered modalities its tokenizer has markers for."""
        slots, owner = self._slots()
        default_spec().extended((), slots, owner)  # a clash is an error even when this tokenizer lacks the slot
        return VocabSpec.from_tokenizer_dir(path, embedding_rows, media=tuple(m.kind for m in self.modalities.values()),
                                            slots=slots)

    def _slots(self) -> tuple[dict[int, tuple[str, str]], dict[str, str]]:
        slots: dict[int, tuple[str, str]] = {}
        owner: dict[str, str] = {}
        for m in self.modalities.values():
            for slot, (name, literal) in m.slots.items():
                slots[int(slot)] = (name, literal)
                owner[name] = m.name
        return slots, owner


def get_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh plugin manager with the built-in modalities and (by default) the ``apertus`` entry points.

    The built-in judges and reward functions, and the adapters' subcommands, arrive through the
    package's own entry points (``[project.entry-points.apertus]``), the path a third party takes.
    """
    from . import builtin

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(ApertusHookSpecs)
    pm.register(builtin, name="apertus.builtin.modalities")
    if load_entry_points:
        pm.load_setuptools_entrypoints(PROJECT)
    check_hooks(pm)
    return pm


def check_hooks(pm: pluggy.PluginManager) -> None:
    """Refuse a plugin that implements a hook the contract does not declare (a typo, or a hook an
    older version had), naming the plugin and the hook."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) or repr(exc.plugin)
        raise ValueError(f"apertus plugin {name!r}: {exc} (the hooks are "
                         f"{', '.join(sorted(n for n in dir(ApertusHookSpecs) if n.startswith('apertus_')))})") from exc


def _merge(kind: str, results: list[tuple[str, Any]], out: dict[str, Any], owner: dict[str, str]) -> None:
    for plugin_name, contribution in results:
        items = contribution.items() if isinstance(contribution, Mapping) else ((c.name, c) for c in contribution)
        for name, value in items:
            if name in out:
                raise ValueError(
                    f"{kind} {name!r} is registered twice: by {owner[f'{kind}:{name}']} and by {plugin_name}"
                )
            out[name] = value
            owner[f"{kind}:{name}"] = plugin_name


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Collect every plugin's contributions into a :class:`Registry`."""
    check_hooks(pm)
    reg = Registry()
    owner: dict[str, str] = {}
    for hook_name, kind, target in (
        ("apertus_modalities", "modality", reg.modalities),
        ("apertus_judges", "judge", reg.judges),
        ("apertus_reward_functions", "reward function", reg.reward_functions),
        ("apertus_commands", "command", reg.commands),
    ):
        results = []
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            value = impl.function()
            if value:
                results.append((impl.plugin_name, value))
        _merge(kind, results, target, owner)
    reg.plugins = {name: str(plugin) for name, plugin in pm.list_name_plugin()}
    return reg


@lru_cache(maxsize=1)
def registry() -> Registry:
    """The process-wide registry (built-ins plus installed ``apertus`` plugins), built once."""
    return build_registry(get_plugin_manager())


def spec(base: VocabSpec | None = None) -> VocabSpec:
    """:meth:`Registry.spec` of the process-wide registry: the layout with every installed modality."""
    return registry().spec(base)


def spec_from_tokenizer_dir(path: str | Path, embedding_rows: int | None = None) -> VocabSpec:
    """:meth:`Registry.spec_from_tokenizer_dir` of the process-wide registry."""
    return registry().spec_from_tokenizer_dir(path, embedding_rows)


def make_judge(name: str = "openai", **config: Any) -> Any:
    """Build the judge backend registered as ``name`` (``apertus_judges`` hook) from its config."""
    judges = registry().judges
    if name not in judges:
        raise KeyError(f"unknown judge backend {name!r}; registered: {', '.join(sorted(judges))}")
    return judges[name](**config)


def serving_layout(modality: str = "image") -> str:
    """The layout a server uses unless told otherwise: the modality's first registered layout."""
    return registry().modalities[modality].layouts[0]
