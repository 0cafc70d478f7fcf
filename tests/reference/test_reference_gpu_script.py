"""The prepared GPU benchmark (benchmarks/gpu/encoders.py) runs its whole path on CPU with --cpu-test.

No GPU here: this keeps the script from rotting (argument handling, FLOP ceilings, the CPU/GPU code
comparison, TF32 refused on CPU, the JSON it writes); the GPU figures themselves need a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_script_cpu_path(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "encoders.py"), "--cpu-test"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "encoders_gpu.json").read_text())
    f32 = res["precisions"]["float32"]
    assert f32["images_per_s"] > 0 and f32["clips_per_s"] > 0
    # Measured rate against the ceiling is a timing on a shared machine: the script prints it, the test
    # only checks that a ceiling was computed (a rate beside another job can land on either side).
    assert 0 < f32["images_per_s_ceiling"] < float("inf") and 0 < f32["clips_per_s_ceiling"] < float("inf")
    assert f32["image_codes_differing"] == 0 and f32["audio_codes_differing"] == 0  # CPU against CPU
    assert "CUDA" in res["precisions"]["tf32"]["skipped"]
    assert "images/s at 128x128" in r.stdout and "FLOP ceiling" in r.stdout
