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


def test_the_packed_attention_is_exact_per_rank() -> None:
    """The harness's THD attention against a dense causal document mask, whole and as each CP rank computes it."""
    import numpy as np
    import torch
    from cpu_attention import packed_attention, reference_attention

    from apertus_plugins.core.packing import cp_partition_indices, pad_to_multiple

    g = torch.Generator().manual_seed(0)
    for cp in (1, 2, 4):
        lengths = pad_to_multiple([5, 17, 3, 30, 9], 2 * cp)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        t = int(cu[-1])
        q, k, v = (torch.randn(t, heads, 8, generator=g, dtype=torch.float64) for heads in (4, 2, 2))
        documents = np.repeat(np.arange(lengths.size), lengths)
        want = reference_attention(q, k, v, documents, scale=0.3)
        whole = packed_attention(q, k, v, cu, np.arange(t), np.arange(t), 0.3)
        assert torch.allclose(whole, want, rtol=0, atol=1e-12)
        # each rank: its queries (chunks r and 2cp-1-r of every document) against the keys gathered in rank order
        order = np.concatenate([cp_partition_indices(cu, cp, r) for r in range(cp)])
        for r in range(cp):
            mine = cp_partition_indices(cu, cp, r)
            got = packed_attention(q[mine], k[order], v[order], cu, mine, order, 0.3)
            assert torch.allclose(got, want[mine], rtol=0, atol=1e-12), (cp, r)
