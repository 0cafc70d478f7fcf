"""The same plan on a real Ray cluster: ``apertus tokenize ... --ray-address`` runs every batch as a Ray task.

The test starts a one-CPU Ray head on loopback (``ray start --head --block`` in its own process
group, stopped by signalling that group only), runs the pipeline against it from a separate
driver process, and compares the output byte for byte with the reference run on local worker
processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _offline_data import cli, outputs, reference, workspace


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "1",
         "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats", "--object-store-memory",
         str(100 * 2**20), "--temp-dir", temp],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            probe = subprocess.run([ray, "status", "--address", address], capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the Ray head did not start:\n{head.stdout.read() if head.stdout else ''}")
            time.sleep(1)
        yield address
    finally:
        # the head's children (GCS, raylet, workers) share its process group: stop that group only
        try:
            os.killpg(head.pid, signal.SIGTERM)
            time.sleep(3)
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_tasks_write_the_same_bytes(tmp_path: Path, ray_cluster: str) -> None:
    ws = workspace()
    ref = reference("pretrain")
    out = tmp_path / "ray" / "pretrain"
    res = cli(ws.pretrain_args(out, "--ray-address", ray_cluster))
    assert res.returncode == 0, res.stdout + res.stderr
    assert outputs(out) == outputs(ref)
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["run"]["ray_address"] == ray_cluster and report["run"]["workers"] == 0
