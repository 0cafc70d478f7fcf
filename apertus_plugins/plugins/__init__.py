"""The plugin system over the core: the hooks a plugin implements and the registry that collects them.

- :mod:`.hooks`: the contract of an ``apertus`` plugin (hook markers, specifications, :class:`Modality`);
- :mod:`.manager`: the plugin manager and :func:`registry`, what the loaded plugins contribute;
- :mod:`.builtin`: the built-in image and audio modalities, registered through the same hooks.

The registry sits on top of the core: :func:`spec` / :func:`spec_from_tokenizer_dir` merge the
registered modalities into a :class:`~apertus_plugins.core.vocab.VocabSpec`, which callers hand down
to the core (``normalize_messages(..., spec=...)``, ``ChatTokenizer(dir, spec)``...); the core never
asks the registry.
"""

from .hooks import PROJECT, ApertusHookSpecs, Modality, hookimpl, hookspec
from .manager import (
    Registry,
    build_registry,
    check_hooks,
    get_plugin_manager,
    make_judge,
    registry,
    serving_layout,
    spec,
    spec_from_tokenizer_dir,
)

__all__ = ["PROJECT", "hookspec", "hookimpl", "Modality", "ApertusHookSpecs", "Registry", "build_registry",
           "check_hooks", "get_plugin_manager", "make_judge", "registry", "serving_layout", "spec",
           "spec_from_tokenizer_dir"]
