"""Import a script of this repository (``tools/``, ``benchmarks/``) that is not a package, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: str | Path, name: str) -> ModuleType:
    """The module of the Python file ``path``, imported once under ``name`` (kept in ``sys.modules``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(path))
        if spec is None or spec.loader is None:
            raise ImportError(f"{path}: not a Python file that can be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
