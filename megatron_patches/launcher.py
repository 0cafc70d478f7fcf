"""``apertus-megatron SCRIPT [Megatron flags] [--apertus-...]``: run an upstream Megatron-LM script with the plugin.

The launcher does what ``python SCRIPT ...`` does (``sys.argv``, the script's directory first on
``sys.path``, ``__name__ == "__main__"``), after it has

1. checked the ``megatron.core`` that the script will import (a supported version, else a clear error);
2. activated the plugin on Megatron-LM's training entry (``megatron.training``: from the user's
   checkout with 0.16, packaged in the megatron-core wheel from 0.19), through the form it has:

   * 0.16 (``pretrain(dataset_provider, model_provider, model_type, forward_step,
     extra_args_provider=...)``): ``pretrain`` is wrapped so that the ``--apertus-*`` arguments join
     the script's ``extra_args_provider`` and the Apertus dataset provider, model provider and
     forward step (:mod:`megatron_patches.training`) replace the script's;
   * 0.19 (``parse_and_validate_args(extra_args_provider=...)`` then ``pretrain(config_container,
     dataset_provider, model_type, forward_step, ...)``): ``parse_and_validate_args`` adds the
     arguments, ``pretrain`` swaps the providers and sets the container's layer spec, RoPE scaling
     factor and vocabulary rows;

   ``train_step`` and ``training_log`` are wrapped (both forms) so that a step whose global batch
   holds no loss target skips its optimizer step and says so, and the per-modality losses are
   logged over their own targets (:func:`megatron_patches.training.wrap_train_step`); and
   megatron-core's optimizer construction gets the Apertus weight-decay rule and, on request,
   AdEMAMix (:mod:`megatron_patches.optimizer`) once the arguments are parsed.

``--apertus-recipe NAME`` (:mod:`megatron_patches.recipes`) is expanded into the stage's flags
before the script sees its arguments, and printed. The script itself is never modified. A script that does not import ``megatron.training`` runs with
the plugin active all the same (its own code may call :func:`megatron_patches.arguments.add_apertus_args`).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ApertusRunError, PreflightError
from .version import SUPPORTED, SUPPORTED_RANGE, MegatronVersionError, megatron_core_version

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


# ------------------------------------------------------------------------------------ the patches
def _on_args_ready(args: Any) -> None:
    """After Megatron has parsed its arguments: build the options, install the optimizer rules."""
    from . import optimizer, training
    from .arguments import describe_options, options_from_args

    options = options_from_args(args)
    training.set_options(options)
    if os.environ.get("RANK", "0") == "0":
        print(f" [apertus] {describe_options(options)}", flush=True)
    if getattr(args, "mock_data", False):
        raise PreflightError("--mock-data is not supported with apertus-megatron (the Apertus targets need "
                                      "real indexed datasets)")
    optimizer.install(options)


def _pretrain_016(original: Any) -> Any:
    from . import training
    from .arguments import add_apertus_args, chain_extra_args

    def model_provider(*a: Any, **kw: Any) -> Any:
        from megatron.training import get_args

        if not training._OPTIONS:
            _on_args_ready(get_args())
        return training.model_provider(*a, **kw)

    @functools.wraps(original)
    def pretrain(train_valid_test_dataset_provider: Any, model_provider_: Any, model_type: Any,
                 forward_step_func: Any, process_non_loss_data_func: Any = None, extra_args_provider: Any = None,
                 *args: Any, **kwargs: Any) -> Any:
        return original(training.train_valid_test_datasets_provider, model_provider, model_type,
                        training.forward_step, process_non_loss_data_func,
                        chain_extra_args(extra_args_provider, add_apertus_args), *args, **kwargs)

    pretrain.__apertus_original__ = original  # type: ignore[attr-defined]
    return pretrain


def _parse_and_validate_019(original: Any) -> Any:
    from .arguments import add_apertus_args, chain_extra_args

    @functools.wraps(original)
    def parse_and_validate_args(extra_args_provider: Any = None, *args: Any, **kwargs: Any) -> Any:
        parsed = original(chain_extra_args(extra_args_provider, add_apertus_args), *args, **kwargs)
        _on_args_ready(parsed)
        return parsed

    parse_and_validate_args.__apertus_original__ = original  # type: ignore[attr-defined]
    return parse_and_validate_args


def _pretrain_019(original: Any) -> Any:
    from . import training

    @functools.wraps(original)
    def pretrain(cfg_container: Any, train_valid_test_dataset_provider: Any, model_type: Any,
                 forward_step_func: Any, *args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        from .spec import apertus_layer_spec, check_apertus_config

        margs = get_args()
        options = training.get_options()
        model = getattr(cfg_container, "model", None)
        if model is not None:
            use_te = margs.transformer_impl == "transformer_engine"
            check_apertus_config(model.transformer)

            def layer_spec(config: Any, vp_stage: int | None = None) -> Any:
                return apertus_layer_spec(use_te)

            model.transformer_layer_spec = layer_spec
            model.rope_scaling = bool(margs.use_rope_scaling)
            model.rope_scaling_factor = float(margs.rope_scaling_factor)  # upstream leaves the default 8
            model.share_embeddings_and_output_weights = False
            model.vocab_size = training.embedding_rows(margs, options)
            model.should_pad_vocab = False
        else:
            kwargs["model_provider"] = training.model_provider
        return original(cfg_container, training.train_valid_test_datasets_provider, model_type,
                        training.forward_step, *args, **kwargs)

    pretrain.__apertus_original__ = original  # type: ignore[attr-defined]
    return pretrain


def _initialize_megatron(original: Any) -> Any:
    """Megatron's initialization, then the preflight: once per job, on rank 0, its verdict broadcast."""

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        from . import training

        out = original(*args, **kwargs)
        training.preflight_from_args(get_args(), training.get_options())
        return out

    initialize_megatron.__apertus_original__ = original  # type: ignore[attr-defined]
    return initialize_megatron


def _patch_training_loop(training_mod: Any) -> None:
    """Steps without targets and per-modality logging (:func:`megatron_patches.training.wrap_train_step`);
    the preflight right after Megatron's initialization."""
    from .training import wrap_train_step, wrap_training_log

    if not callable(getattr(training_mod, "initialize_megatron", None)):
        raise LauncherError("Megatron-LM's megatron.training.training has no initialize_megatron; supported: "
                            f"megatron-core {SUPPORTED_RANGE}")
    _patch(training_mod, "initialize_megatron", _initialize_megatron)

    for name, make, want in (("train_step", wrap_train_step, ["forward_step_func", "data_iterator", "model",
                                                                  "optimizer"]),
                             ("training_log", wrap_training_log, ["loss_dict", "total_loss_dict"])):
        fn = getattr(training_mod, name, None)
        fn = getattr(fn, "__apertus_original__", fn)
        params = list(inspect.signature(fn).parameters)[:len(want)] if fn is not None else []
        if params != want or (name == "training_log" and not {"iteration", "skipped_iter"} <= set(
                inspect.signature(fn).parameters)):
            raise LauncherError(f"Megatron-LM's megatron.training.training.{name} has an unexpected form "
                                f"({params}); supported: megatron-core {SUPPORTED_RANGE}")
        _patch(training_mod, name, make)


def _patch(module: Any, name: str, make: Any) -> None:
    current = getattr(module, name)
    if hasattr(current, "__apertus_original__"):
        return
    setattr(module, name, make(current))


def activate(script: str | os.PathLike[str] | None = None) -> ActivePlugin:
    """Check megatron-core and patch Megatron-LM's training entry (see the module docstring); idempotent.

    Raises :class:`LauncherError` for an unsupported version, or when ``script`` imports
    ``megatron.training`` and no Megatron-LM checkout provides it.
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
        training_pkg = importlib.import_module("megatron.training")
        training_mod = importlib.import_module("megatron.training.training")
        form = training_form(getattr(training_mod.pretrain, "__apertus_original__", training_mod.pretrain))
        _patch_training_loop(training_mod)
        if form == "0.16":
            _patch(training_mod, "pretrain", _pretrain_016)
        else:
            arguments_mod = importlib.import_module("megatron.training.arguments")
            _patch(arguments_mod, "parse_and_validate_args", _parse_and_validate_019)
            _patch(training_mod, "pretrain", _pretrain_019)
        training_pkg.pretrain = training_mod.pretrain
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
