"""TEST CODE ONLY: import Megatron-Bridge 0.6.2 on a machine without Transformer Engine.

``megatron.bridge.peft.lora_layers`` (imported by the conversion path through ``peft_bridge``) runs
``import transformer_engine.pytorch as te`` at its top and reads ``te.ops.Sequential`` in an
annotation; nothing on the conversion or model-provider path calls Transformer Engine, and Transformer
Engine cannot be installed without CUDA. :func:`import_megatron_bridge` imports ``megatron.bridge``
with a finder that hands a placeholder ``transformer_engine`` to that one module only (found by the
importing frame): every other importer (megatron-core's own probes) still gets ``ImportError``, so
megatron-core keeps its no-TE paths. The placeholders raise if anything instantiates them, and they
are dropped from ``sys.modules`` afterwards; :func:`import_megatron_bridge` checks that megatron-core
did not take one for Transformer Engine. On a GPU machine Transformer Engine is installed and this
module is not used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__all__ = ["import_megatron_bridge"]

#: The one module given the placeholder.
IMPORTER = "megatron.bridge.peft.lora_layers"
NAMES = ("transformer_engine", "transformer_engine.pytorch")


class _Placeholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__name__}: Transformer Engine is not installed (CPU test shim)")


def _placeholder_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []

    def attr(key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return type(key, (_Placeholder,), {})

    mod.__getattr__ = attr  # type: ignore[attr-defined]
    if name == "transformer_engine.pytorch":
        mod.ops = types.SimpleNamespace(Sequential=type("Sequential", (_Placeholder,), {}))  # type: ignore[attr-defined]
    return mod


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in NAMES:
            return None
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_globals.get("__name__") == IMPORTER:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            frame = frame.f_back
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _placeholder_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def import_megatron_bridge() -> types.ModuleType:
    """``import megatron.bridge`` without Transformer Engine (see the module); returns the package.

    Where Transformer Engine is installed and imports (a GPU machine), it is a plain import."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries
        pass
    else:
        import megatron.bridge

        return megatron.bridge
    import megatron.core.models.gpt.gpt_layer_specs as specs  # megatron-core probes for TE first, for real

    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        import megatron.bridge
    finally:
        sys.meta_path.remove(finder)
        for name in reversed(NAMES):
            sys.modules.pop(name, None)
    if getattr(specs, "HAVE_TE", False):
        raise RuntimeError("megatron-core took the Transformer Engine placeholder for the real package")
    return megatron.bridge
