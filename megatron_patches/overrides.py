"""Every function of Megatron's that the adapter wraps: the places where Megatron offers no hook.

The plugin enters Megatron through the ways in Megatron has, and this module holds what is left.
The ways in:

* the parameters of Megatron-LM's ``pretrain``: the dataset provider, the forward step (with the
  loss function and its report), the model provider and ``extra_args_provider`` (0.16);
* Megatron-LM 0.19's model configs: the script's config container reaches ``pretrain`` as a copy
  whose model is :class:`~megatron_patches.model_builder.ApertusModelConfig`, a ``GPTModelConfig``
  naming the plugin's builder (the path Megatron's own ModelOpt integration takes);
* megatron-core's layer specs (:mod:`megatron_patches.spec`), ``GPTDataset`` and
  ``BlendedMegatronDatasetBuilder`` (:mod:`megatron_patches.dataset`);
* Megatron's own arguments: ``--apertus-embedding-rows`` is ``--padded-vocab-size`` under the
  plugin's name (:mod:`megatron_patches.arguments`);
* the skipped-step accounting: an optimizer step that returns ``update_successful=False`` is a
  skipped iteration to Megatron (no parameter, scheduler or loss-average update, counted in its
  log line);
* the per-step losses: the loss function's report, ``[sum, count]`` pairs that Megatron sums over
  the micro-batches and the data- and context-parallel ranks before it divides.

Each entry of :data:`OVERRIDES` names the upstream function it wraps, the versions whose source it
was read at (with a digest of that source: :func:`source_digest`), what the wrapper does and why
no hook serves. :func:`install` (called by the launcher) checks each function's parameters and
fails naming the function when they changed; ``tests/megatron-train/test_overrides.py`` (Megatron-LM
0.19.2 and megatron-core 0.19.2) and ``tests/megatron/test_overrides.py`` (megatron-core 0.16.1)
compare the installed sources with the digests. The Megatron-LM 0.16.1 digests were taken from
the ``core_v0.16.1`` tag of Megatron-LM (no Megatron-LM 0.16 is installable from a package index).

Megatron is imported inside the functions only: the launcher imports this module before it has
checked the installed megatron-core.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .ademamix import AdEMAMixSettings
from .arguments import add_apertus_args, chain_extra_args
from .errors import ApertusRunError

__all__ = ["Override", "OVERRIDES", "UpstreamChangedError", "source_digest", "digest_in_source", "applicable",
           "check", "install", "installed", "SkipStepsWithoutTargets", "IntervalLosses", "optimizer_builder",
           "adam_replaced_by_ademamix", "TRAINING", "CORE_OPTIMIZER"]

TRAINING = "megatron.training.training"
CORE_OPTIMIZER = "megatron.core.optimizer"


class UpstreamChangedError(RuntimeError):
    """A Megatron function the adapter wraps is missing or no longer has the parameters the wrapper binds."""


@dataclasses.dataclass(frozen=True)
class Override:
    """One wrapped upstream function."""

    module: str  #: the module whose attribute is replaced
    name: str  #: the function's name there
    forms: tuple[str, ...]  #: the training-entry forms it applies to ("0.16", "0.19")
    requires: tuple[str, ...]  #: the leading parameters the wrapper binds, in order
    named: tuple[str, ...]  #: further parameters the wrapper reads by name
    checked: Mapping[str, str]  #: upstream version -> digest of the source the wrapper was written against
    does: str  #: what the wrapper does
    why: str  #: why no hook serves
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    also: tuple[str, ...] = ()  #: further modules whose attribute of the same name is the same function

    @property
    def target(self) -> str:
        return f"{self.module}.{self.name}"


# ------------------------------------------------------------------------------------------ digests
def digest_in_source(text: str, name: str) -> str:
    """sha256 (16 hex digits) of the module-level function ``name`` in the module source ``text``.

    The function's lines, decorators included, exactly as written: any edit of the function changes
    the digest, edits elsewhere in the module do not.
    """
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            segment = "\n".join(lines[first - 1:node.end_lineno])
            return hashlib.sha256(segment.encode("utf-8")).hexdigest()[:16]
    raise UpstreamChangedError(f"no module-level function {name!r} in the source")


def source_digest(fn: Callable[..., Any]) -> str:
    """:func:`digest_in_source` of ``fn`` (through any wrappers: the innermost function's own source)."""
    fn = inspect.unwrap(fn)
    path = inspect.getsourcefile(fn)
    if path is None:
        raise UpstreamChangedError(f"{fn.__module__}.{fn.__qualname__}: no source file")
    return digest_in_source(Path(path).read_text(encoding="utf-8"), fn.__name__)


# ------------------------------------------------------------------------------------------ the entry
def _training() -> Any:
    from . import training

    return training


def _with_arguments(original: Callable[..., Any], edit: Callable[[dict[str, Any]], None]) -> Callable[..., Any]:
    """``original`` whose bound arguments ``edit`` changes in place (by name, whatever the caller's order) first."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        edit(bound.arguments)
        return original(*bound.args, **bound.kwargs)

    return wrapper


def _apertus_steps(a: dict[str, Any]) -> Any:
    """The Apertus dataset provider and forward step, in ``pretrain``'s arguments; returns the training module."""
    training = _training()
    a["train_valid_test_dataset_provider"] = training.train_valid_test_datasets_provider
    a["forward_step_func"] = training.forward_step
    return training


def _pretrain_016(original: Callable[..., Any]) -> Callable[..., Any]:
    def edit(a: dict[str, Any]) -> None:
        training = _apertus_steps(a)
        a["model_provider"] = training.model_provider
        a["extra_args_provider"] = chain_extra_args(a.get("extra_args_provider"), add_apertus_args)

    return _with_arguments(original, edit)


def _pretrain_019(original: Callable[..., Any]) -> Callable[..., Any]:
    def edit(a: dict[str, Any]) -> None:
        training = _apertus_steps(a)
        container = a["cfg_container"]
        if getattr(container, "model", None) is None:  # a container without a model config: the provider path
            a["model_provider"] = training.model_provider
            return
        from .model_builder import ApertusModelConfig

        if not dataclasses.is_dataclass(container):
            raise UpstreamChangedError(f"pretrain's config container {type(container).__name__} is not a "
                                       "dataclass (megatron.training.config.PretrainConfigContainer)")
        a["cfg_container"] = dataclasses.replace(container, model=ApertusModelConfig.from_config(container.model))

    return _with_arguments(original, edit)


def _parse_and_validate_args(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def parse_and_validate_args(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["extra_args_provider"] = chain_extra_args(bound.arguments.get("extra_args_provider"),
                                                                   add_apertus_args)
        parsed = original(*bound.args, **bound.kwargs)
        _training().get_options(parsed)  # a bad --apertus-* flag stops the run here, before anything starts
        return parsed

    return parse_and_validate_args


# ------------------------------------------------------------------------------------------ steps without targets
class SkipStepsWithoutTargets:
    """The optimizer as ``train_step`` sees it: Megatron's, whose ``step()`` skips a step without targets.

    ``step()`` first sums the step's target counts over every rank (:class:`~megatron_patches.training.StepTargets`);
    when the global batch holds none it returns ``(False, None, None)``, Megatron's "update not
    successful": no parameter, optimizer-state or learning-rate update from a zero gradient, and the
    iteration counts as skipped. ``--apertus-empty-steps error`` raises instead. Every other
    attribute is the optimizer's own; the optimizer itself is not modified.
    """

    def __init__(self, optimizer: Any, *, modalities: int, empty_steps: str) -> None:
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_size", 1 + modalities)
        object.__setattr__(self, "_empty_steps", empty_steps)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._optimizer, name, value)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        targets = _training().step_targets()
        total = targets.reduce(self._size)
        if total[0] > 0:
            return self._optimizer.step(*args, **kwargs)
        targets.empty_steps += 1
        if self._empty_steps == "error":
            raise ApertusRunError("a training step's global batch holds no loss target (every label masked: SFT "
                                  "samples without an assistant turn, or modality weights of 0); --apertus-empty-steps "
                                  "error stops here")
        return False, None, None


def _is_last_rank() -> bool:
    import torch

    dist = torch.distributed
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def _train_step(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        training = _training()
        options = training.get_options()
        targets = training.step_targets()
        targets.reset()
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("optimizer") is not None:
            bound.arguments["optimizer"] = SkipStepsWithoutTargets(
                bound.arguments["optimizer"], modalities=len(options.spec.modality_names),
                empty_steps=options.empty_steps)
        out = original(*bound.args, **bound.kwargs)
        total = targets.total  # None when the optimizer's step did not run (an exit before it)
        if total is None or not isinstance(out, tuple) or not isinstance(out[0], dict):
            return out
        if total[0] == 0:
            iteration = bound.arguments.get("iteration")
            if iteration is None:
                from megatron.training import get_args

                iteration = get_args().curr_iteration
            if _is_last_rank():
                print(f" [apertus] iteration {int(iteration) + 1:8d}: the global batch holds no loss target (every "
                      f"label masked); the optimizer step is skipped ({targets.empty_steps} step(s) without targets "
                      "so far)", flush=True)
            losses: dict[str, Any] = {}  # 0/0 each: no loss to log, and no "nan iteration"
        else:
            absent = {f"{name} loss" for k, name in enumerate(options.spec.modality_names) if total[1 + k] == 0}
            losses = {k: v for k, v in out[0].items() if k not in absent}
        return (losses, *out[1:])

    return train_step


# ------------------------------------------------------------------------------------------ the log
#: The counters Megatron keeps in its accumulator dict beside the losses.
MEGATRON_COUNTERS = ("advanced iterations", "skipped iterations", "nan iterations")


class IntervalLosses:
    """The losses of one logging interval: for each key, the sum of its step values and how many steps had it.

    Megatron's ``training_log`` adds each trained step's losses into its accumulator and prints
    ``accumulator[key] / advanced iterations`` for every key it holds. :meth:`prepare` fills the
    accumulator handed to it (the plugin's own) so that the printed value is each key's mean over
    the steps that had it, and leaves out a key no step of the interval had; a key present in every
    trained step is left to Megatron's own sum, bit for bit.
    """

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.steps: dict[str, int] = {}

    def prepare(self, accumulator: dict[str, Any], losses: Mapping[str, Any], *, skipped: bool, log_now: bool) -> None:
        """Before Megatron's ``training_log`` of one step: record the step, and at a log line set the accumulator."""
        trained = {} if skipped else dict(losses)
        if log_now:
            advanced = int(accumulator.get(MEGATRON_COUNTERS[0], 0)) + (0 if skipped else 1)
            for key in list(self.sums) + [k for k in trained if k not in self.sums]:
                before = self.sums.get(key)
                n = self.steps.get(key, 0) + (key in trained)
                if n == advanced:  # Megatron's own average: the sum so far, this step added by Megatron
                    value = before
                else:
                    total = trained[key] if before is None else (before if key not in trained else before + trained[key])
                    value = total * (advanced / n) - (trained[key] if key in trained else 0)
                if value is None:
                    accumulator.pop(key, None)
                else:
                    accumulator[key] = value
        for key, value in trained.items():
            value = value.detach() if hasattr(value, "detach") else value
            self.sums[key] = value if key not in self.sums else self.sums[key] + value
            self.steps[key] = self.steps.get(key, 0) + 1

    def finish(self, accumulator: dict[str, Any], *, interval_ended: bool) -> None:
        """After Megatron's ``training_log``: the losses leave the accumulator; an ended interval starts afresh."""
        for key in self.sums:
            accumulator.pop(key, None)
        if interval_ended:
            self.sums.clear()
            self.steps.clear()


def _training_log(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)
    interval = IntervalLosses()
    accumulator: dict[str, Any] = {}  # the plugin's, handed to Megatron as total_loss_dict (Megatron's stays unused)
    run: list[Any] = [None]  # Megatron's own dict of the current train() call, only compared

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        if a["total_loss_dict"] is not run[0]:  # a new train() call (an in-process restart): start afresh
            run[0] = a["total_loss_dict"]
            accumulator.clear()
            interval.finish(accumulator, interval_ended=True)
        iteration = int(a["iteration"])
        skipped = bool(a.get("skipped_iter", 0))
        first = bool(a.get("is_first_iteration", False))
        log_interval = get_args().log_interval
        if first and iteration % log_interval == 0:
            # Megatron keeps its accumulators after a first line, as a preview of the interval it starts;
            # at an interval's end (--log-interval 1, a resumed run at a multiple of it) that line is the
            # interval's own and the next starts afresh
            a["is_first_iteration"] = first = False
        log_now = iteration % log_interval == 0 or first
        interval.prepare(accumulator, a["loss_dict"], skipped=skipped, log_now=log_now)
        a["total_loss_dict"] = accumulator
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            interval.finish(accumulator, interval_ended=log_now and not first)

    return training_log


# ------------------------------------------------------------------------------------------ the optimizer
@contextlib.contextmanager
def adam_replaced_by_ademamix(settings: AdEMAMixSettings) -> Iterator[None]:
    """Inside the block, megatron-core's optimizer module builds AdEMAMix where it builds ``Adam``."""
    import megatron.core.optimizer as mco

    from .optimizer import MegatronAdEMAMix

    saved = (mco.Adam, mco.USING_PYTORCH_OPTIMIZER, MegatronAdEMAMix.settings)
    MegatronAdEMAMix.settings = settings
    mco.Adam, mco.USING_PYTORCH_OPTIMIZER = MegatronAdEMAMix, False
    try:
        yield
    finally:
        mco.Adam, mco.USING_PYTORCH_OPTIMIZER, MegatronAdEMAMix.settings = saved


def optimizer_builder(original: Callable[..., Any], options: Callable[[], Any]) -> Callable[..., Any]:
    """megatron-core's ``_get_megatron_optimizer_based_on_param_groups`` with the Apertus rules of ``options()``."""
    from .optimizer import AdEMAMix, ademamix_init_state_fn, apply_weight_decay_rule, check_ademamix_config

    @functools.wraps(original)
    def build(config: Any, model_chunks: Any, param_groups: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        opts = options()
        apply_weight_decay_rule(param_groups, opts.weight_decay_on)
        if opts.optimizer != "ademamix":
            return original(config, model_chunks, param_groups, *args, **kwargs)
        check_ademamix_config(config)
        with adam_replaced_by_ademamix(opts.ademamix):
            optimizer = original(config, model_chunks, param_groups, *args, **kwargs)
        if isinstance(optimizer, tuple):  # 0.19 with skip_megatron_wrapping: (torch optimizer, init_state_fn)
            opt, init_fn = optimizer
            return opt, (ademamix_init_state_fn if isinstance(opt, AdEMAMix) else init_fn)
        # the checkpoint-loading template of the optimizer just built: AdEMAMix's three state tensors
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            if isinstance(getattr(sub, "optimizer", None), AdEMAMix):
                sub.init_state_fn = ademamix_init_state_fn
        return optimizer

    return build


def _optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    return optimizer_builder(original, lambda: _training().get_options())


# ------------------------------------------------------------------------------------------ the list
OVERRIDES: tuple[Override, ...] = (
    Override(
        module=TRAINING, name="pretrain", also=("megatron.training",), forms=("0.16",),
        requires=("train_valid_test_dataset_provider", "model_provider", "model_type", "forward_step_func"),
        named=("extra_args_provider",),
        checked={"0.16.1": "560f4ee32cd5a457"},
        does="passes the Apertus dataset provider, model provider and forward step, and the script's "
             "extra_args_provider chained with the --apertus-* group, through pretrain's own parameters",
        why="the script calls pretrain with its own providers; Megatron has no registry through which a "
            "package supplies them",
        make=_pretrain_016),
    Override(
        module=TRAINING, name="pretrain", also=("megatron.training",), forms=("0.19",),
        requires=("cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func"),
        named=("model_provider",),
        checked={"0.19.2": "7b60d7fc0dd9a9fc"},
        does="passes the Apertus dataset provider and forward step through pretrain's parameters, and a copy "
             "of the script's config container whose model is ApertusModelConfig (the plugin's builder)",
        why="the script calls pretrain with its own providers and container; Megatron has no registry "
            "through which a package supplies them",
        make=_pretrain_019),
    Override(
        module="megatron.training.arguments", name="parse_and_validate_args", forms=("0.19",),
        requires=("extra_args_provider",), named=(),
        checked={"0.19.2": "8fc63dea4813642c"},
        does="adds the --apertus-* group through its extra_args_provider parameter (chained with the "
             "script's) and builds the Apertus options from the parsed arguments",
        why="the script parses the arguments itself, before pretrain, with its own extra_args_provider",
        make=_parse_and_validate_args),
    Override(
        module=TRAINING, name="train_step", forms=("0.16", "0.19"),
        requires=("forward_step_func", "data_iterator", "model", "optimizer"), named=("iteration",),
        checked={"0.16.1": "699a199151a4c4c3", "0.19.2": "1823abf71532698f"},
        does="hands train_step the optimizer through SkipStepsWithoutTargets (step() returns Megatron's "
             "update_successful=False for a global batch without targets) and leaves the modalities without "
             "targets out of the step's losses (a step without any: no losses)",
        why="Megatron decides a step's update only from the fp16 grad scaler's found-inf; no hook can veto "
            "an update, and the step's losses are 0/0 (NaN) for a key without targets",
        make=_train_step),
    Override(
        module=TRAINING, name="training_log", forms=("0.16", "0.19"),
        requires=("loss_dict", "total_loss_dict"), named=("iteration", "skipped_iter", "is_first_iteration"),
        checked={"0.16.1": "b0652aefc0376181", "0.19.2": "7e7ebec01bcf0d56"},
        does="keeps each logging interval's losses in the plugin's own accumulator (IntervalLosses), handed "
             "to Megatron as total_loss_dict: each key's mean over the steps that had it, a key no step of "
             "the interval had left out; a first line at an interval's end resets the interval",
        why="training_log divides every key by the interval's advanced iterations, prints every key it has "
            "seen (as 0 after a reset: a skipped-only interval logs 'lm loss: 0'), and keeps its "
            "accumulators after the run's first line also when that line ends an interval; no parameter "
            "or hook changes this accounting",
        make=_training_log),
    Override(
        module=CORE_OPTIMIZER, name="_get_megatron_optimizer_based_on_param_groups", forms=("0.16", "0.19"),
        requires=("config", "model_chunks", "param_groups"), named=(),
        checked={"0.16.1": "176a5068cd92e4d5", "0.19.2": "f4f1d380077e510b"},
        does="--apertus-weight-decay-on all: every parameter group decays; --apertus-optimizer ademamix: "
             "while it runs, the module's Adam (and USING_PYTORCH_OPTIMIZER) is MegatronAdEMAMix, and the "
             "built optimizer's init_state_fn creates AdEMAMix's state",
        why="pretrain builds the optimizer itself: its param-group overrides (get_standard_config_overrides: "
            "no decay on 1-D parameters) and the optimizer class (a module global, --optimizer choices fixed) "
            "are reached by no parameter of pretrain and no registry",
        make=_optimizer),
)


def applicable(form: str | None) -> list[Override]:
    """The overrides of a training-entry form (``"0.16"``, ``"0.19"``; ``None``: none, the script is megatron-core only)."""
    return [o for o in OVERRIDES if form in o.forms]


def _original(fn: Any) -> Any:
    return getattr(fn, "__apertus_original__", fn)


def digest_problem(override: Override, version: str) -> str | None:
    """What to do when ``override``'s upstream function on megatron-core ``version`` is not the source the
    wrapper was written against (not checked on that version, or its digest differs); None when it is.

    The suites of each supported version call it for every override that applies there.
    """
    digest = source_digest(check(override))
    if version not in override.checked:
        return (f"{override.target} was not checked on megatron-core {version} (only {sorted(override.checked)}): "
                f"read it, check what the wrapper relies on ({override.does}), then add {version!r}: {digest!r}")
    if digest != override.checked[version]:
        return (f"{override.target} changed in megatron-core {version}: source digest {digest}, the override was "
                f"written against {override.checked[version]}. Re-read it, check what the wrapper relies on "
                f"({override.does}), then record the new digest")
    return None


def check(override: Override, fn: Any | None = None) -> Any:
    """The upstream function of ``override`` (or ``fn``), checked to take the parameters the wrapper binds.

    Raises :class:`UpstreamChangedError` naming the function, the parameters it has and needs, and
    the versions the override was checked on.
    """
    from .version import SUPPORTED_RANGE

    where = f"checked on {', '.join(override.checked)}; supported: {SUPPORTED_RANGE}"
    if fn is None:
        try:
            fn = getattr(importlib.import_module(override.module), override.name)
        except (ImportError, AttributeError) as exc:
            raise UpstreamChangedError(f"{override.target} is missing ({exc}): apertus-megatron wraps it ({where})") \
                from exc
    fn = _original(fn)
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        raise UpstreamChangedError(f"{override.target} has no signature ({exc}); {where}") from exc
    missing = [p for p in override.named if p not in params]
    if params[:len(override.requires)] != list(override.requires) or missing:
        raise UpstreamChangedError(
            f"{override.target}{tuple(params)} has changed: apertus-megatron's wrapper binds "
            f"{list(override.requires)} first and {list(override.named)} by name ({where})")
    return fn


def install(form: str | None) -> list[str]:
    """Wrap the upstream functions of ``form``'s overrides (checked first; idempotent); returns their names."""
    todo = [(o, check(o)) for o in applicable(form)]  # check every one before wrapping any
    done = []
    for override, _ in todo:
        module = importlib.import_module(override.module)
        current = getattr(module, override.name)
        if not hasattr(current, "__apertus_original__"):
            wrapped = override.make(current)
            wrapped.__apertus_original__ = current  # type: ignore[attr-defined]
            setattr(module, override.name, wrapped)
            current = wrapped
        for alias in override.also:
            setattr(importlib.import_module(alias), override.name, current)
        done.append(override.target)
    return done


def installed(form: str | None) -> bool:
    """Whether every override of ``form`` is in place."""
    return all(hasattr(getattr(importlib.import_module(o.module), o.name), "__apertus_original__")
               for o in applicable(form))

