"""The encoders' CPU thread policy (apertus_plugins.encoders.threads): sized to the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from apertus_plugins.encoders import encode_threads, planned_threads
from apertus_plugins.encoders import threads as policy
from apertus_plugins.testing.random_weights import random_audio_tokenizer, random_vision_tokenizer


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    a = torch.randn(256, 256)
    while time.perf_counter() < end:
        a = torch.tanh(a @ a * 1e-3)


@pytest.fixture
def all_cores():
    saved = torch.get_num_threads()
    torch.set_num_threads(_cores())
    yield _cores()
    torch.set_num_threads(saved)


def test_env_pins_or_disables_the_policy(monkeypatch, all_cores):
    monkeypatch.setenv(policy.ENV_VAR, "1")
    assert planned_threads() == 1
    with encode_threads("cpu") as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == all_cores  # restored
    monkeypatch.setenv(policy.ENV_VAR, "off")
    with encode_threads("cpu") as n:
        assert n == all_cores == torch.get_num_threads()


@pytest.mark.parametrize("bad", ["0", "-2", "many", "1.5"])
def test_a_bad_setting_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(policy.ENV_VAR, bad)
    with pytest.raises(policy.ThreadPolicyError, match=f"{policy.ENV_VAR}=.*auto.*off"):
        planned_threads()


def test_gpu_encodes_leave_torch_alone(monkeypatch, all_cores):
    monkeypatch.setenv(policy.ENV_VAR, "1")
    with encode_threads("cuda") as n:
        assert n == all_cores == torch.get_num_threads()


def test_the_setting_is_restored_after_an_error(monkeypatch, all_cores):
    monkeypatch.setenv(policy.ENV_VAR, "1")
    with pytest.raises(RuntimeError), encode_threads("cpu"):
        raise RuntimeError("encoder failed")
    assert torch.get_num_threads() == all_cores


def test_arithmetic_of_the_plan(monkeypatch, all_cores):
    """Other processes' CPU time over the wall time of the call = cores they kept busy."""
    monkeypatch.setenv(policy.ENV_VAR, "auto")
    monkeypatch.setattr(policy, "_busy_elsewhere", 0.0)  # restored afterwards: the plan of later encodes
    clock = iter([100.0, 100.0 + 1.0])  # the machine: 1 s of busy CPU during the call (ours included)
    monkeypatch.setattr(policy, "_machine_busy_s", lambda: next(clock))
    monkeypatch.setattr(policy, "_cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    t = iter([0.0, 0.5])  # the call lasted 0.5 s
    monkeypatch.setattr(policy.time, "perf_counter", lambda: next(t))
    cpu = iter([0.0, 0.0])  # and this process used no CPU: 1 s / 0.5 s = 2 cores busy elsewhere
    monkeypatch.setattr(policy.time, "process_time", lambda: next(cpu))
    with encode_threads("cpu"):
        pass
    assert planned_threads() == 2
    monkeypatch.setattr(policy, "_busy_elsewhere", 0.2)
    assert planned_threads() == 4
    monkeypatch.setattr(policy, "_busy_elsewhere", 7.0)
    assert planned_threads() == 1  # never below one thread


def test_a_busy_neighbour_takes_a_thread_away(monkeypatch, all_cores):
    """A real busy process beside the encode: the next encode plans fewer threads than cores."""
    monkeypatch.setenv(policy.ENV_VAR, "auto")
    monkeypatch.setattr(policy, "_busy_elsewhere", 0.0)  # the load measured here is not left to later encodes
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        with encode_threads("cpu"):
            _spin(1.0)
        assert planned_threads() <= max(1, all_cores - 1)
    finally:
        busy.kill()
        busy.wait()


def test_codes_do_not_depend_on_the_thread_count(monkeypatch):
    vision, audio = random_vision_tokenizer(seed=3), random_audio_tokenizer(seed=4)
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.uniform(-1, 1, (2, 3, 64, 96)).astype(np.float32))
    wave = torch.from_numpy((0.3 * rng.standard_normal((2, 7_000))).astype(np.float32))
    codes = {}
    for setting in ("1", "2"):
        monkeypatch.setenv(policy.ENV_VAR, setting)
        codes[setting] = (vision.encode(pixels), audio.encode(wave))
    assert torch.equal(codes["1"][0], codes["2"][0])
    assert torch.equal(codes["1"][1], codes["2"][1])
