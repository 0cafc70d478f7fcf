"""Continued pretraining through ``apertus-megatron`` with Megatron's real ``pretrain()`` loop on CPU.

The blend holds the three kinds of data a stage mixes: images and audio clips tokenized by
``apertus tokenize pretrain`` (captions and transcripts inside) and plain text, with a manifest;
the image weight follows a step schedule (1 for three iterations, 0 from the fourth on),
Goldfish drops targets, the end-of-document rule applies and AdEMAMix steps (two micro-batches
per step). The log must show every iteration with a finite ``lm loss`` and the per-modality
losses beside it, each over the trained targets: the image loss disappears with the image weight.
"""

from __future__ import annotations

from pathlib import Path

from conftest import PRETRAIN_ITERS, Data, Run, assert_trained, model_flags, torchrun, train_flags


def test_pretraining_blend(pretrain_run: Run) -> None:
    run = pretrain_run
    assert_trained(run, PRETRAIN_ITERS, keys=("lm loss", "text loss"))
    rows = {r["iteration"]: r for r in run.rows}
    # images weigh 1 through the third iteration (Megatron's 0-based step 2) and 0 from the fourth on:
    # their loss is logged while they are trained, never after
    assert any("image loss" in rows[i] for i in (1, 2, 3)), run.log[-3000:]
    assert not any("image loss" in rows[i] for i in range(4, PRETRAIN_ITERS + 1))
    assert any("audio loss" in r for r in run.rows) and any("omni loss" in r for r in run.rows)
    # every trained target weighs 1 here, so lm loss (the trained objective, over the same targets,
    # token-weighted) is a mix of the per-modality losses: it lies within their range
    for r in run.rows:
        mods = [v for k, v in r.items() if k.endswith(" loss") and k != "lm loss"]
        assert min(mods) - 1e-5 <= r["lm loss"] <= max(mods) + 1e-5, r
    assert rows[PRETRAIN_ITERS]["lm loss"] < rows[1]["lm loss"], [r["lm loss"] for r in run.rows]
    assert "optimizer AdEMAMix" in run.log and "Goldfish k=4 h=4" in run.log
    assert run.log.count("[apertus] preflight:") == 1 and "verified (sizes and counts)" in run.log
    print("pretraining lm loss:", [round(r["lm loss"], 4) for r in run.rows])


def test_long_context_packing(data: Data, tmp_path: Path) -> None:
    """``--apertus-bfd-data``: pretraining documents packed best-fit-decreasing, documents kept apart; the
    blend must be the manifest's; a recipe's flags are printed and an explicit flag wins."""
    run = torchrun([*model_flags(seq=128), *train_flags(data, iters=3), "--data-path", "0.5", data.text, "0.5",
                    data.images, "--apertus-bfd-data", data.text, data.images,
                    "--apertus-manifest", str(data.pretrain_manifest)], cwd=tmp_path, check=False)
    assert run.returncode != 0 and "not one of the run's data prefixes" not in run.log
    assert "the datasets do not match the manifest" in run.log and "in the manifest but missing" in run.log
    # with a shipped recipe, one of its flags overridden on the command line
    run = torchrun([*model_flags(seq=128), *train_flags(data, iters=3), "--data-path", "0.5", data.text, "0.5",
                    data.images, "--apertus-bfd-data", data.text, data.images, "--apertus-recipe", "goldfish",
                    "--apertus-goldfish-h", "4"], cwd=tmp_path)
    assert_trained(run, 3, keys=("lm loss", "text loss"))
    assert run.log.count("packed best-fit-decreasing") == 2, run.log[-3000:]
    assert "[apertus] recipe goldfish (Goldfish loss k=50 h=50): --apertus-goldfish-k 50 | overridden: " \
           "--apertus-goldfish-h" in run.log
    assert "Goldfish k=50 h=4 hashtable" in run.log
