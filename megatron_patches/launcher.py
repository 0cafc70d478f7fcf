"""``apertus-megatron SCRIPT [Megatron flags] [--apertus-...]``: run an upstream Megatron-LM script with the plugin.

The launcher does what ``python SCRIPT ...`` does (``sys.argv``, the script's directory first on
``sys.path``, ``__name__ == "__main__"``), after it has

1. expanded ``--apertus-recipe NAME`` (:mod:`megatron_patches.recipes`) into the stage's flags,
   put before the command line's and printed;
2. checked the ``megatron.core`` that the script will import (a supported version, else a clear error);
3. activated the plugin on Megatron-LM's training entry (``megatron.training``: from the user's
   checkout with 0.16, packaged in the megatron-core wheel from 0.19), told apart by the form of
   ``pretrain`` (:func:`training_form`), with the overrides of :mod:`megatron_patches.overrides`:
   the script's call of ``pretrain`` gets the Apertus dataset provider, forward step and model
   (0.16: the model provider and the ``--apertus-*`` group as ``extra_args_provider``; 0.19: the
   config container's model as :class:`~megatron_patches.model_builder.ApertusModelConfig`, the
   group through ``parse_and_validate_args``), a step without targets is skipped, the log's
   losses are each over their own targets, and megatron-core's optimizer construction applies
   the Apertus weight-decay rule and, on request, AdEMAMix.

The script itself is never modified. A script that does not import ``megatron.training`` runs with
the plugin active all the same (its own code may call :func:`megatron_patches.arguments.add_apertus_args`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import overrides
from .errors import ApertusRunError
from .version import SUPPORTED, MegatronVersionError, megatron_core_version

__all__ = ["LauncherError", "ActivePlugin", "active", "activate", "training_form", "run_script", "main",
           "script_imports_megatron_training"]

USAGE = """usage: apertus-megatron SCRIPT [ARGS...]

Run an upstream Megatron-LM training script (pretrain_gpt.py) for Apertus 1.5. ARGS are the script's
own Megatron flags plus the --apertus-* flags (see `apertus-megatron SCRIPT --help`, group "apertus").
--apertus-recipe NAME puts a stage's flags (SPEC.md 6) before yours; a flag you pass replaces the
recipe's. `apertus-megatron --recipes` lists them.
The script must come from a Megatron-LM checkout matching the installed megatron-core
(0.16.x or 0.19.x); its directory is put first on sys.path, as `python SCRIPT` does.
"""


class LauncherError(RuntimeError):
    """The script cannot be run with the plugin (missing file, no Megatron-LM, unsupported version)."""


@dataclass(frozen=True)
class ActivePlugin:
    """What :func:`activate` did: the megatron-core version and the training entry form it patched."""

    version: str
    form: str | None  # "0.16" or "0.19" (Megatron-LM's training entry), None without megatron.training
    script: str | None = None


_ACTIVE: list[ActivePlugin] = []


def active() -> ActivePlugin | None:
    """The plugin's state in this process (``None`` when the launcher has not activated it)."""
    return _ACTIVE[0] if _ACTIVE else None


def script_imports_megatron_training(path: str | os.PathLike[str]) -> bool:
    """Whether the script's source imports ``megatron.training`` (the Megatron-LM part, not in the wheel)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "megatron.training" or node.module.startswith("megatron.training.")):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "megatron" and any(
                a.name == "training" for a in node.names):
            return True
        if isinstance(node, ast.Import) and any(
                a.name == "megatron.training" or a.name.startswith("megatron.training.") for a in node.names):
            return True
    return False


def training_form(pretrain: Any) -> str:
    """``"0.16"`` or ``"0.19"`` from the signature of Megatron-LM's ``pretrain``; raises if neither."""
    params = list(inspect.signature(pretrain).parameters)
    if params[:4] == ["train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func"] \
            and "extra_args_provider" in params:
        return "0.16"
    if len(params) >= 4 and params[1:4] == ["train_valid_test_dataset_provider", "model_type", "forward_step_func"]:
        return "0.19"
    raise LauncherError(f"Megatron-LM's pretrain{tuple(params)} has neither supported form (0.16: pretrain("
                        "dataset_provider, model_provider, model_type, forward_step, extra_args_provider=...); 0.19: "
                        "pretrain(config_container, dataset_provider, model_type, forward_step, ...))")


def activate(script: str | os.PathLike[str] | None = None) -> ActivePlugin:
    """Check megatron-core and install the overrides on Megatron-LM's training entry (see the module docstring).

    Idempotent. Raises :class:`LauncherError` for an unsupported version, an upstream function the
    overrides cannot wrap (named), or when ``script`` imports ``megatron.training`` and no
    Megatron-LM checkout provides it.
    """
    if _ACTIVE:
        return _ACTIVE[0]
    try:
        version = megatron_core_version()
        from .version import check_version

        check_version(version)
    except MegatronVersionError as exc:
        raise LauncherError(str(exc)) from exc
    form = None
    if importlib.util.find_spec("megatron.training") is not None:
        training_mod = importlib.import_module("megatron.training.training")
        form = training_form(getattr(training_mod.pretrain, "__apertus_original__", training_mod.pretrain))
        try:
            overrides.install(form)
        except overrides.UpstreamChangedError as exc:
            raise LauncherError(str(exc)) from exc
    elif script is not None and script_imports_megatron_training(script):
        raise LauncherError(
            f"{script} imports megatron.training, which the megatron-core wheel does not include (before 0.19 it "
            "lives only in Megatron-LM). Run the script from a Megatron-LM checkout that matches the installed "
            "megatron-core (its directory is put on sys.path), or put the checkout on PYTHONPATH. Supported: "
            + ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED))
    state = ActivePlugin(version=version, form=form, script=None if script is None else str(script))
    _ACTIVE.append(state)
    return state


def run_script(script: str | os.PathLike[str], argv: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``argv`` and the plugin active."""
    path = Path(script)
    if not path.is_file():
        raise LauncherError(f"{script}: no such script")
    path = path.resolve()
    from .recipes import expand_recipes

    argv, report = expand_recipes(argv)
    if report and os.environ.get("RANK", "0") == "0":
        for line in report:
            print(f" [apertus] {line}", flush=True)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))
    activate(path)
    runpy.run_path(str(path), run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``apertus-megatron``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--recipes":
        from .recipes import RECIPES

        for r in RECIPES.values():
            print(f"{r.name:26s} {r.summary}\n{'':26s} {' '.join(r.flags)}")
        return 0
    try:
        run_script(argv[0], argv[1:])
    except (LauncherError, ApertusRunError) as exc:
        print(f"apertus-megatron: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # `python -m megatron_patches.launcher`: run the package's own module, so that the script sees the
    # plugin state (`megatron_patches.launcher.active()`) of the module it imports
    from .launcher import main as _main

    sys.exit(_main())
