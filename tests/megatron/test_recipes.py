"""The SPEC.md section 6 stages as ``--apertus-recipe`` flags: numbers, overrides, derived flags, flag files.

The recipes are expanded by the launcher before the script parses its arguments, so these run
without Megatron-LM; the megatron-train suite runs one through Megatron for real.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_patches.ademamix import RECIPE as ADEMAMIX
from megatron_patches.arguments import add_apertus_args, options_from_args
from megatron_patches.errors import ApertusArgumentError
from megatron_patches.recipes import RECIPES, WARMUP_TOKENS, expand_recipes, split_flags


def as_dict(argv: list[str]) -> dict[str, list[str]]:
    return {g[0]: g[1:] for g in split_flags(argv)}


def test_continued_pretraining_numbers() -> None:
    argv, report = expand_recipes(["--apertus-recipe", "cpt-8b", "--num-layers", "2"])
    f = as_dict(argv)
    assert f["--lr"] == ["0.00011"] and f["--min-lr"] == ["1.1e-05"] and f["--global-batch-size"] == ["1024"]
    assert f["--seq-length"] == ["8192"] and f["--tensor-model-parallel-size"] == ["2"]
    assert f["--lr-decay-style"] == ["WSD"] and f["--lr-wsd-decay-style"] == ["minus_sqrt"]
    assert f["--clip-grad"] == ["0.1"] and f["--apertus-weight-decay-on"] == ["all"]
    # AdEMAMix comes from the core's recipe (one home), the warm-up of 4.2B tokens in samples of 8192
    assert f["--apertus-ademamix-beta3"] == [f"{ADEMAMIX['betas'][2]:g}"]
    assert f["--apertus-ademamix-alpha-warmup"] == [str(ADEMAMIX["alpha_warmup"])]
    assert f["--lr-warmup-samples"] == [str(round(WARMUP_TOKENS / 8192))] == ["512695"]
    assert argv[-2:] == ["--num-layers", "2"] and "--apertus-recipe" not in argv
    assert "pass as well: --train-samples --lr-wsd-decay-samples" in report[0]
    f70 = as_dict(expand_recipes(["--apertus-recipe", "cpt-70b", "--seq-length", "4096"])[0])
    assert f70["--lr"] == ["2e-05"] and f70["--global-batch-size"] == ["2048"]
    assert f70["--pipeline-model-parallel-size"] == ["8"] and f70["--num-virtual-stages-per-pipeline-rank"] == ["2"]
    assert f70["--lr-warmup-samples"] == [str(round(WARMUP_TOKENS / 4096))]
    with pytest.raises(ApertusArgumentError, match="pass --seq-length"):
        expand_recipes(["--apertus-recipe", "cpt-70b"])


def test_long_context_and_sft_and_goldfish() -> None:
    batches = [int(as_dict(RECIPES[f"long-context-8b-{n}"].flags)["--global-batch-size"][0])
               for n in ("32k", "64k", "128k", "256k")]
    assert batches == [512, 256, 128, 64]
    last = as_dict(list(RECIPES["long-context-8b-256k"].flags))
    assert last["--seq-length"] == ["262144"] and last["--rotary-base"] == ["4000000"]
    assert last["--rope-scaling-factor"] == ["32"] and last["--lr"] == last["--min-lr"] == ["1.1e-05"]
    assert [as_dict(list(RECIPES[f"long-context-70b-{n}"].flags))["--rope-scaling-factor"][0]
            for n in ("32k", "64k", "128k", "256k")] == ["8", "8", "16", "32"]
    sft = as_dict(list(RECIPES["sft-70b"].flags))
    assert sft["--lr"] == ["1e-05"] and sft["--global-batch-size"] == ["1024"] and sft["--weight-decay"] == ["0"]
    assert sft["--lr-warmup-iters"] == ["800"] and sft["--seq-length"] == ["16384"]
    assert as_dict(list(RECIPES["goldfish"].flags)) == {"--apertus-goldfish-k": ["50"], "--apertus-goldfish-h": ["50"]}


def test_explicit_flags_override_and_recipes_compose(tmp_path: Path) -> None:
    argv, report = expand_recipes(["--apertus-recipe", "sft-8b", "--lr", "1e-6", "--apertus-recipe=goldfish",
                                   "--apertus-goldfish-k", "7", "--lr-warmup-iters", "3"])
    f = as_dict(argv)
    assert f["--lr"] == ["1e-6"] and f["--apertus-goldfish-k"] == ["7"] and f["--apertus-goldfish-h"] == ["50"]
    assert argv.count("--lr") == 1 and argv.count("--lr-warmup-iters") == 1
    assert "overridden: --lr --lr-warmup-iters" in report[0] and "overridden: --apertus-goldfish-k" in report[1]
    flagfile = tmp_path / "stage.flags"
    flagfile.write_text("# my stage\n--lr 3e-4   # peak\n--apertus-targets 'text-only'\n")
    argv, report = expand_recipes(["--apertus-recipe", str(flagfile), "--seed", "1"])
    assert argv == ["--lr", "3e-4", "--apertus-targets", "text-only", "--seed", "1"]
    with pytest.raises(ApertusArgumentError, match="no such recipe or file; recipes are cpt-8b"):
        expand_recipes(["--apertus-recipe", "nope"])
    # parsed without the launcher, a recipe is refused with the way to use it
    parser = add_apertus_args(argparse.ArgumentParser())
    with pytest.raises(ApertusArgumentError, match="expanded by the apertus-megatron launcher"):
        options_from_args(parser.parse_args(["--apertus-recipe", "goldfish"]))


def test_launcher_prints_and_applies_the_recipe(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(textwrap.dedent("""
        import sys
        print("ARGV", " ".join(sys.argv[1:]))
    """))
    exe = Path(sys.executable).parent / "apertus-megatron"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megatron_patches.launcher"]
    out = subprocess.run([*cmd, str(script), "--apertus-recipe", "goldfish", "--apertus-goldfish-h", "9"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "[apertus] recipe goldfish (Goldfish loss k=50 h=50): --apertus-goldfish-k 50 | overridden: " \
           "--apertus-goldfish-h" in out.stdout
    assert "ARGV --apertus-goldfish-k 50 --apertus-goldfish-h 9" in out.stdout
    listing = subprocess.run([*cmd, "--recipes"], capture_output=True, text=True, timeout=300)
    assert listing.returncode == 0 and "long-context-70b-256k" in listing.stdout and "sft-8b" in listing.stdout
