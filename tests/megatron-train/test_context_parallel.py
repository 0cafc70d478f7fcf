"""Context parallelism with packed documents: a CP=2 run trains and logs exactly what the CP=1 run does.

``--apertus-packed-sequences`` packs several documents into each sequence (best-fit-decreasing,
``cu_seqlens``), each document padded to a multiple of ``2 x CP`` and split over the CP ranks in
Transformer Engine's load-balanced order; the attention (the harness's exact THD attention,
``cpu_attention.py``, standing in for Transformer Engine's) gathers keys and values over the CP
group. Both runs use the same padding multiple (4), so they read the same samples; the CP=2 run
must log the CP=1 run's losses, per-modality losses, steps without targets and gradient norms
(full precision from the harness) within float32 tolerance:

* multimodal pretraining: images, audio and text packed best-fit-decreasing (``--apertus-bfd-data``)
  with Goldfish and a scheduled image weight;
* SFT: conversations packed with their derived masks, a step without targets (its optimizer step
  skipped on both runs, from target counts summed over the CP ranks);
* CP=2 x TP=2 in four processes, against the same CP=1 run.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import Data, Run, assert_trained, cpu_env, model_flags, torchrun, train_flags

ITERS = 4
PAD = "4"  # 2 x CP for CP=2; the CP=1 reference packs with the same multiple


def packed(data: Data, *extra: str, seq: int = 256) -> list[str]:
    return [*model_flags(seq=seq), *train_flags(data, iters=ITERS, mbs=1, gbs=2), "--apertus-packed-sequences",
            "--apertus-pad-to-multiple", PAD, *extra]


def pretrain_flags(data: Data) -> list[str]:
    return packed(data, "--data-path", "0.5", data.images, "0.2", data.audio, "0.3", data.text,
                  "--apertus-bfd-data", data.images, data.audio, data.text,
                  "--apertus-manifest", str(data.pretrain_manifest), "--apertus-modality-weight", "image=0:1,2:1,3:0",
                  "--apertus-goldfish-k", "4", "--apertus-goldfish-h", "4")


def sft_flags(data: Data) -> list[str]:
    # the text weight is 0 at the third iteration: a step without targets on every rank
    return packed(data, "--data-path", data.sft, "--apertus-sft-data", data.sft, "--apertus-sft-oversize", "split",
                  "--apertus-modality-weight", "text=0:1,1:1,2:0,3:1")


def run(args: list[str], tmp: Path, *, cp: int = 1, tp: int = 1) -> Run:
    flags = [*args, "--context-parallel-size", str(cp), "--tensor-model-parallel-size", str(tp)]
    tmp.mkdir(parents=True, exist_ok=True)
    return torchrun(flags, nproc=cp * tp, cwd=tmp, env=cpu_env(APERTUS_TEST_EXACT_GRAD_NORM="1"))


@pytest.fixture(scope="module")
def pretrain_cp1(data: Data, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run(pretrain_flags(data), tmp_path_factory.mktemp("cp1"))


def documents_per_sample(log: str) -> list[float]:
    found = re.findall(r"(\d+) (?:document|conversation)s packed best-fit-decreasing into (\d+) samples", log)
    return [int(a) / int(b) for a, b in found]


def assert_same(one: Run, two: Run, *, rel: float = 2e-6) -> None:
    a, b = {r["iteration"]: r for r in one.rows}, {r["iteration"]: r for r in two.rows}
    assert a.keys() == b.keys() == set(range(1, ITERS + 1))
    for i in a:
        keys = {k for k in a[i] if k.endswith(" loss") or k in ("grad norm", "no targets")}
        assert keys == {k for k in b[i] if k.endswith(" loss") or k in ("grad norm", "no targets")}, (a[i], b[i])
        for k in keys - {"no targets"}:
            assert math.isclose(a[i][k], b[i][k], rel_tol=rel), (i, k, a[i][k], b[i][k])
        assert a[i]["no targets"] == b[i]["no targets"]


def test_cp2_equals_cp1_multimodal_pretraining(data: Data, pretrain_cp1: Run, tmp_path: Path) -> None:
    two = run(pretrain_flags(data), tmp_path, cp=2)
    assert_trained(pretrain_cp1, ITERS, keys=("lm loss", "text loss"))
    assert "packed sequences (THD cu_seqlens), documents padded to multiples of 4" in two.log
    # several documents share each packed sequence
    assert documents_per_sample(two.log) and min(documents_per_sample(two.log)) >= 2, two.log[-3000:]
    assert any("image loss" in r for r in two.rows) and any("audio loss" in r for r in two.rows)
    assert_same(pretrain_cp1, two)
    print("CP=1:", pretrain_cp1.losses(), "CP=2:", two.losses(), "grad norm:", two.losses("grad norm"))


def test_cp2_equals_cp1_sft(data: Data, tmp_path: Path) -> None:
    one = run(sft_flags(data), tmp_path / "one")
    two = run(sft_flags(data), tmp_path / "two", cp=2)
    assert min(documents_per_sample(two.log)) >= 2, two.log[-3000:]
    assert [r["no targets"] for r in one.rows] == [False, False, True, False]
    assert_same(one, two)
    print("SFT CP=1:", one.losses(), "CP=2:", two.losses())


def test_cp2_tp2_equals_cp1(data: Data, pretrain_cp1: Run, tmp_path: Path) -> None:
    four = run(pretrain_flags(data), tmp_path, cp=2, tp=2)
    assert "initialized tensor model parallel with size 2" in four.log
    assert_same(pretrain_cp1, four, rel=1e-5)  # TP splits the matrix products: float32 rounding differs


def test_long_context_step_starts_from_the_previous_checkpoint(data: Data, tmp_path: Path) -> None:
    """A long-context step as the recipes run it: the previous stage's checkpoint as ``--pretrained-checkpoint``
    (Megatron loads it with a fresh optimizer at iteration 0 while ``--load`` holds none), a new RoPE base, CP=2."""
    prev = tmp_path / "stage"
    first = torchrun([*pretrain_flags(data), "--train-iters", "2", "--save", str(prev), "--save-interval", "2",
                      "--ckpt-format", "torch_dist"], cwd=tmp_path)
    assert max(first.losses()) == 2
    step = tmp_path / "long"
    flags = [*pretrain_flags(data), "--pretrained-checkpoint", str(prev), "--load", str(step), "--save", str(step),
             "--save-interval", "100", "--ckpt-format", "torch_dist", "--rotary-base", "2000000",
             "--context-parallel-size", "2", "--apertus-targets", "text-only"]
    refused = torchrun(flags, nproc=2, cwd=tmp_path, check=False)
    assert refused.returncode != 0 and f"{prev}: the RoPE settings differ from the checkpoint's (rotary_base" in \
        refused.log, refused.log[-3000:]
    started = torchrun([*flags, "--apertus-allow-rope-change"], nproc=2, cwd=tmp_path)
    assert "attempting to finetune with checkpoint in" in started.log
    assert sorted(started.losses()) == list(range(1, ITERS + 1))  # iteration 0: a new stage, not a resume
    assert not any("audio loss" in r for r in started.rows)  # text-only targets (the image weight is scheduled)
