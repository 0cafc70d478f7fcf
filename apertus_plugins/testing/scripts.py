"""The repository's scripts and commands, for its tests: :func:`load_script` imports a script of ``tools/`` or
``benchmarks/`` that is not a package; :func:`run_apertus` runs the ``apertus`` command in a child process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

#: the folder that holds this ``apertus_plugins`` package (the repository's root in a checkout)
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


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


def run_apertus(*args: str, env: Mapping[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m apertus_plugins.cli ARGS`` in a child process of this interpreter, output captured as text.

    The child imports this very package (its parent folder first on ``PYTHONPATH``) with this process's
    environment plus ``env``. Returns the finished process; the caller checks ``returncode``.
    """
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "apertus_plugins.cli", *args], capture_output=True, text=True,
                          env=full, timeout=timeout)
