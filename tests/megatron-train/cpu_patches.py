"""Test harness: megatron-core's model, optimizer, DDP and ``megatron.training.pretrain`` on CPU over gloo.

TEST CODE ONLY. Megatron has no CPU mode; this module patches, in the process that imports it,
the CUDA assumptions that megatron-core 0.19.x (``megatron.core`` and the packaged
``megatron.training``) and, for the model-level part, 0.16.x hit on a machine without a GPU
(measured in this project's notes, "Megatron on CPU"). The package never imports it: the suite's
processes load it through ``cpu_site/sitecustomize.py`` (``PYTHONPATH=tests/megatron-train/cpu_site``
and ``APERTUS_MEGATRON_CPU=1``), so every torchrun worker is patched before the launcher runs.

:func:`install` checks the megatron-core version against :data:`PINNED` and that every name it
replaces still exists; a missing name raises :class:`CpuPatchError` naming it (an upgrade that
renames or removes one must fail here, loudly, not train on with half the patches).

What it does (each one was needed; the notes say where each is hit):

1. the CUDA RNG (``torch.cuda.{get,set}_rng_state``, ``manual_seed[_all]``, megatron-core's
   ``_get_cuda_rng_state``/``_set_cuda_rng_state``) is the CPU generator, so the RNG tracker that
   attention forks works;
2. ``torch.cuda.current_device()`` names the CPU; ``device_count()`` is 1 (``pretrain`` creates
   the model-parallel groups and seeds only when it sees a device), ``set_device`` is a no-op;
3. tensor factories (``torch.tensor``, ``zeros``, ``empty``, ``full``, ``arange``, ``rand*``,
   ``*_like``...) and ``Tensor.to``/``Tensor.cuda``/``Module.cuda`` map a CUDA device to the CPU;
4. gradient clipping: megatron-core's ``clip_grad_by_total_norm_fp32`` asserts CUDA tensors, a CPU
   version replaces it (in ``optimizer.clip_grads`` and where ``optimizer.optimizer`` imported it);
5. streams and events (``current_stream``, ``Stream``, ``stream``, ``Event``) are inert objects;
   ``synchronize``/``empty_cache`` are no-ops and the memory statistics read 0;
6. ``megatron.training.training.initialize_megatron`` runs with ``allow_no_cuda=True``;
7. ``megatron.core.datasets.utils.compile_helpers`` is a no-op (the wheel ships the compiled
   helper but no Makefile);
8. ``megatron.training.arguments.get_device_arch_version`` returns a constant (TP > 1 asks);
9. ``megatron.training.initialize._warmup_jit_function`` is a no-op: it compiles the fused
   bias-GeLU and bias-dropout-add kernels on CUDA tensors, which a run with those fusions off
   (``--no-bias-gelu-fusion --no-bias-dropout-fusion``, as on CPU) never calls;
10. the local layer spec's core attention (``megatron.core.models.backends.LocalSpecProvider``) is
    ``cpu_attention.PackedAttention``: megatron-core's ``DotProductAttention`` plus packed sequences
    (THD ``cu_seqlens``) and context parallelism over gloo, exact (keys and values gathered over the
    CP group, documents and causality by global position), where upstream's refuses both and
    Transformer Engine needs a GPU.

``torch.cuda.is_available()`` stays ``False``: code that asks takes its CPU path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
from typing import Any

import torch

__all__ = ["PINNED", "CpuPatchError", "install", "installed", "megatron_version", "kill_after_checkpoint",
           "print_exact_grad_norm", "use_composed_xielu", "print_step_cpu_time"]

#: megatron-core (major, minor) -> what is patched for it. 0.16 has no ``megatron.training``.
PINNED = {(0, 19): "model, optimizer, DDP and megatron.training.pretrain", (0, 16): "model, optimizer and DDP"}

_INSTALLED: list[tuple[int, int]] = []
_CPU = torch.device("cpu")


class CpuPatchError(RuntimeError):
    """A name the harness patches is gone, or megatron-core is a version the harness was not written for."""


def megatron_version() -> tuple[str, tuple[int, int]]:
    from megatron.core import package_info

    version = str(package_info.__version__)
    m = re.match(r"^(\d+)\.(\d+)", version)
    if m is None:
        raise CpuPatchError(f"cpu_patches: cannot read the megatron-core version {version!r}")
    return version, (int(m.group(1)), int(m.group(2)))


class _Targets:
    """Resolves ``module.name`` pairs; collects every missing one so one error lists them all."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.missing: list[str] = []

    def get(self, module: str, name: str) -> tuple[Any, Any]:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            self.missing.append(f"{module} (cannot import: {exc})")
            return None, None
        if not hasattr(mod, name):
            self.missing.append(f"{module}.{name}")
            return mod, None
        return mod, getattr(mod, name)

    def check(self) -> None:
        if self.missing:
            raise CpuPatchError(
                f"cpu_patches was written for megatron-core {', '.join(f'{a}.{b}.x' for a, b in PINNED)}; in "
                f"{self.version} these patched names are gone: {', '.join(self.missing)}. Re-check each patch "
                "against the new release (tests/megatron-train/cpu_patches.py) before training on CPU again.")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _host(device: Any) -> Any:
    return _CPU if _is_cuda(device) else device


def _factory(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapped.__cpu_patch__ = fn  # type: ignore[attr-defined]
    return wrapped


class _Stream:
    """Inert stand-in for ``torch.cuda.Stream``/``Event``: every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = _CPU

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _rng_patches() -> dict[str, Any]:
    gen = torch.default_generator
    return {
        "get_rng_state": lambda device="cuda": gen.get_state(),
        "set_rng_state": lambda new_state, device="cuda": gen.set_state(new_state),
        "manual_seed": lambda seed: gen.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: gen.manual_seed(int(seed)),
        "seed": lambda: gen.seed(),
        "initial_seed": lambda: gen.initial_seed(),
    }


def _const(value: Any) -> Any:
    """A fresh function returning ``value`` (torch.compile's trace rules reject one object under two names)."""
    return lambda *a, **k: value


def _cuda_patches() -> dict[str, Any]:
    return {
        "current_device": lambda: _CPU,
        "device_count": lambda: 1,
        "set_device": _const(None),
        "synchronize": _const(None),
        "empty_cache": _const(None),
        "current_stream": lambda *a, **k: _Stream(),
        "default_stream": lambda *a, **k: _Stream(),
        "Stream": _Stream,
        "Event": _Stream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "memory_allocated": _const(0),
        "max_memory_allocated": _const(0),
        "memory_reserved": _const(0),
        "max_memory_reserved": _const(0),
        "reset_peak_memory_stats": _const(None),
        "memory_stats": lambda *a, **k: {},
        "is_current_stream_capturing": lambda: False,
    }


_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
              "linspace", "eye")


def _clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: Any,
                                  use_decoupled_grad: bool = False) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` without its CUDA type assertion (same math)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for p in parameters:
        g = getattr(p, "decoupled_grad", None) if use_decoupled_grad else p.grad
        if g is not None:
            grads.append(g.detach())
    clip = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip, torch.Tensor):
        clip = clip.clamp_max(1.0)
        for g in grads:
            g.mul_(clip)
    elif clip < 1.0:
        for g in grads:
            g.mul_(clip)


def install() -> tuple[int, int]:
    """Apply the patches in this process (idempotent); returns megatron-core's ``(major, minor)``."""
    if _INSTALLED:
        return _INSTALLED[0]
    if torch.cuda.is_available():
        raise CpuPatchError("cpu_patches is for machines without CUDA; this one has a GPU: run without it")
    version, key = megatron_version()
    if key not in PINNED:
        raise CpuPatchError(f"cpu_patches was written for megatron-core {', '.join(f'{a}.{b}.x' for a, b in PINNED)}, "
                            f"not {version}: re-check every patch against that release first")
    t = _Targets(version)
    # --- what must exist before anything is replaced
    cuda_names = {**_rng_patches(), **_cuda_patches()}
    for name in cuda_names:
        t.get("torch.cuda", name)
    for name in _FACTORIES:
        t.get("torch", name)
    rnd, _ = t.get("megatron.core.tensor_parallel.random", "_get_cuda_rng_state")
    t.get("megatron.core.tensor_parallel.random", "_set_cuda_rng_state")
    clip_mod, _ = t.get("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32")
    opt_mod, _ = t.get("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32")
    helpers, _ = t.get("megatron.core.datasets.utils", "compile_helpers")
    backends, provider = t.get("megatron.core.models.backends", "LocalSpecProvider")
    t.get("megatron.core.transformer.dot_product_attention", "DotProductAttention")
    if provider is not None and not hasattr(provider, "core_attention"):
        t.missing.append("megatron.core.models.backends.LocalSpecProvider.core_attention")
    if key >= (0, 19):
        train_mod, init_fn = t.get("megatron.training.training", "initialize_megatron")
        args_mod, _ = t.get("megatron.training.arguments", "get_device_arch_version")
        init_mod, _ = t.get("megatron.training.initialize", "_warmup_jit_function")
    t.check()

    # 1, 2, 5: torch.cuda
    for name, value in cuda_names.items():
        setattr(torch.cuda, name, value)
    torch.cuda.random.get_rng_state = cuda_names["get_rng_state"]  # type: ignore[assignment]
    torch.cuda.random.set_rng_state = cuda_names["set_rng_state"]  # type: ignore[assignment]
    rnd._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (  # noqa: E731
        torch.default_generator.get_state())
    rnd._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (  # noqa: E731
        torch.default_generator.set_state(new_state))
    # 3: factories and moves
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not hasattr(fn, "__cpu_patch__"):
            setattr(torch, name, _factory(fn))
    tensor_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(_host(a) if _is_cuda(a) and not isinstance(a, int) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    # 4: gradient clipping
    clip_mod.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    opt_mod.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    # 7: dataset helpers
    helpers.compile_helpers = lambda: None
    # 10: packed sequences and context parallelism in the local attention
    import cpu_attention

    cpu_attention.install(backends)
    if key >= (0, 19):
        # 6: initialize_megatron without CUDA (pretrain() does not pass allow_no_cuda)
        original = init_fn

        @functools.wraps(original)
        def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
            kwargs["allow_no_cuda"] = True
            return original(*args, **kwargs)

        train_mod.initialize_megatron = initialize_megatron
        # 8: the device architecture (TP > 1 asks in validate_args)
        args_mod.get_device_arch_version = lambda: 9
        # 9: no torch.compile warm-up of the fused bias-GeLU/dropout-add kernels (CUDA tensors; a run with
        # the fusions off never calls them)
        init_mod._warmup_jit_function = lambda *a, **k: None
    _INSTALLED.append(key)
    return key


def installed() -> bool:
    return bool(_INSTALLED)


def kill_after_checkpoint(iteration: int) -> None:
    """Fault injection for the resume test: SIGKILL this rank right after the checkpoint of ``iteration``.

    Wraps ``megatron.training.training.save_checkpoint_and_time``; the rank dies the way a
    preempted job does, with no cleanup, once that checkpoint is on disk, together with its
    process group (torchrun starts each rank in its own; the checkpoint writer's worker processes
    are in it and would otherwise be orphaned).
    """
    import os
    import signal

    t = _Targets(megatron_version()[0])
    mod, original = t.get("megatron.training.training", "save_checkpoint_and_time")
    t.check()

    @functools.wraps(original)
    def save_checkpoint_and_time(it: int, *args: Any, **kwargs: Any) -> Any:
        out = original(it, *args, **kwargs)
        if int(it) == iteration:
            print(f"[cpu_patches] checkpoint of iteration {it} written; killing rank (SIGKILL)", flush=True)
            if os.getpgrp() == os.getpid():  # the rank leads its own group: end its helpers with it
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    mod.save_checkpoint_and_time = save_checkpoint_and_time


def print_exact_grad_norm() -> None:
    """Print every step's gradient norm to full precision (Megatron's log line rounds it to three decimals).

    Wraps ``megatron.training.training.training_log`` (the launcher's wrapper goes around this one):
    the last rank prints ``[cpu_patches] iteration N grad norm X`` with ``repr(float)``.
    """
    import torch.distributed as dist

    t = _Targets(megatron_version()[0])
    mod, original = t.get("megatron.training.training", "training_log")
    t.check()

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        import inspect

        bound = inspect.signature(original).bind(*args, **kwargs)
        norm = bound.arguments.get("grad_norm")
        last = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        if last and norm is not None:
            print(f"[cpu_patches] iteration {int(bound.arguments['iteration'])} grad norm {float(norm)!r}", flush=True)
        return original(*args, **kwargs)

    mod.training_log = training_log


def use_composed_xielu() -> None:
    """Run the Apertus MLP with the composed xIELU formula instead of the fused function (the benchmark's "before")."""
    from megatron_patches.spec import XIELU

    XIELU.fused = False


def print_step_cpu_time() -> None:
    """Print each training step's CPU time (``time.process_time``, this rank's process) beside Megatron's wall time.

    On a machine shared with other jobs the wall time per iteration swings with their load; the
    CPU time a step takes does much less (the runs are single-threaded). The last rank prints
    ``[cpu_patches] iteration N cpu ms X``.
    """
    import time

    import torch.distributed as dist

    t = _Targets(megatron_version()[0])
    mod, original = t.get("megatron.training.training", "train_step")
    t.check()
    count = [0]

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        out = original(*args, **kwargs)
        count[0] += 1
        if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
            print(f"[cpu_patches] iteration {count[0]} cpu ms {1000 * (time.process_time() - start):.3f}", flush=True)
        return out

    mod.train_step = train_step
