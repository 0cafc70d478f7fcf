"""``apertus tokenize --merge parts`` feeds Megatron-LM's ``--data-args-path`` in the real training loop.

The suite's images are tokenized as one dataset per plan part (planning shards of two files, a
caption beside each image, windows of two items: three parts). The run's ``OUT.data-args.txt``
replaces ``--data-path`` and its manifest is the stage's ``--apertus-manifest``: Megatron-LM reads
the part prefixes and their token weights from the file (``get_blend_and_blend_per_split``), the
adapter's preflight checks that list against the manifest, and ``pretrain()`` trains on it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import Data, assert_trained, model_flags, torchrun, train_flags


def test_merge_parts_trains_through_data_args_path(data: Data, tmp_path: Path) -> None:
    out = tmp_path / "parts" / "images"
    cmd = [sys.executable, "-m", "apertus_plugins.cli", "tokenize", "pretrain", str(data.root / "in" / "img"),
           "--out", str(out), "--tokenizer", str(data.tokenizer), "--checkpoint", str(data.checkpoint), "--workers",
           "0", "--no-progress", "--merge", "parts", "--plan-files", "2", "--window", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data_args = Path(f"{out}.data-args.txt")
    words = data_args.read_text().split()
    weights, prefixes = [int(w) for w in words[0::2]], words[1::2]
    assert prefixes == [f"{out}.part{p:06d}" for p in (0, 2, 4)] and all(w > 0 for w in weights)
    assert not Path(f"{out}.bin").exists()

    run = torchrun([*model_flags(), *train_flags(data, iters=3), "--data-args-path", str(data_args),
                    "--apertus-manifest", f"{out}.manifest.json"], cwd=tmp_path)
    assert_trained(run, 3, keys=("lm loss", "image loss"))
    assert "verified (sizes and counts)" in run.log
    # a part missing from the file is refused by the preflight against the manifest
    short = tmp_path / "short.txt"
    short.write_text(" ".join(words[:4]) + "\n")
    run = torchrun([*model_flags(), *train_flags(data, iters=1), "--data-args-path", str(short),
                    "--apertus-manifest", f"{out}.manifest.json"], cwd=tmp_path, check=False)
    assert run.returncode != 0 and "the datasets do not match the manifest" in run.log
    assert f"{out}.part000004" in run.log
