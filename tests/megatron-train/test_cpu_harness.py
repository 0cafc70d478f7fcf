"""The CPU harness is pinned: an unknown megatron-core version or a patched name that disappeared fails loudly.

Each check runs in a fresh interpreter (the harness patches the process it is installed in).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import HERE, cpu_env


def python(code: str) -> subprocess.CompletedProcess[str]:
    env = cpu_env()
    env.pop("APERTUS_MEGATRON_CPU", None)  # the site hook stays out: the snippets install the harness themselves
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=HERE)


def test_installs_on_the_pinned_version() -> None:
    out = python("""
        import torch, cpu_patches
        from megatron.core.tensor_parallel import random
        print(cpu_patches.install(), torch.cuda.current_device(), torch.cuda.device_count(),
              torch.zeros(2, device="cuda").device, torch.cuda.is_available())
        state = random._get_cuda_rng_state()
        assert torch.equal(state, torch.get_rng_state())
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(0,", "19)", "cpu", "1", "cpu", "False"]


def test_a_missing_name_fails_loudly() -> None:
    out = python("""
        import cpu_patches
        import megatron.core.tensor_parallel.random as r
        import megatron.training.training as t
        del r._set_cuda_rng_state
        del t.initialize_megatron
        cpu_patches.install()
    """)
    assert out.returncode != 0 and "CpuPatchError" in out.stderr
    assert "megatron.core.tensor_parallel.random._set_cuda_rng_state" in out.stderr
    assert "megatron.training.training.initialize_megatron" in out.stderr
    assert "Re-check each patch" in out.stderr


def test_an_unpinned_version_is_refused() -> None:
    out = python("""
        import cpu_patches
        from megatron.core import package_info
        package_info.__version__ = "0.20.1"
        cpu_patches.install()
    """)
    assert out.returncode != 0 and "written for megatron-core 0.19.x, 0.16.x, not 0.20.1" in out.stderr
