"""The report's training stages as ``--apertus-recipe`` flags: every value against a table written from the report.

The recipes are expanded by the launcher before the script parses its arguments, so these run
without Megatron-LM; the megatron-train suite runs one through Megatron for real.

:data:`REPORT` is written from the Apertus 1.5 technical report ("From Open Text Models to Open
Multimodal Reasoners"), section by section, independently of ``megatron_patches.recipes``;
:func:`expected_flags` turns it into the
flags each recipe must hold, and :func:`test_every_recipe_value_is_the_reports` compares them flag
for flag, both ways: a changed number, a dropped flag or a flag the table does not explain fails.
Where the report gives no number for something a run needs, the table says where the value comes
from (``derived``).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from megatron_patches.arguments import add_apertus_args, options_from_args
from megatron_patches.errors import ApertusArgumentError
from megatron_patches.recipes import RECIPES, expand_recipes, split_flags

#: The numbers, as the report states them.
REPORT: dict[str, Any] = {
    # section 3.2 and Appendix G (text under Table G.1): AdEMAMix with Apertus 1.0's momentum parameters
    "ademamix": {"beta1": 0.9, "beta2": 0.999, "beta3": 0.9999, "alpha": 8, "beta3_warmup": 100_000,
                 "alpha_warmup": 100_000},
    # Appendix G: "gradient clipping at 0.1, and weight decay of 0.1, applied also to the xIELU parameters and
    # the normalization gains"
    "clip": 0.1, "weight_decay": 0.1,
    # section 3.2: "We keep the Goldfish loss of Apertus 1.0 with its parameters unchanged" (k = h = 50, SPEC.md 4.1);
    # the long-context extension is "the fourth and last stage of continued pretraining" (section 3.3)
    "goldfish": {"k": 50, "h": 50},
    # section 3.3: "The main runs initially keep the base frequency of 500,000 and scaling factor of 8"
    "main_rope": (500_000, 8),
    # Table G.1: continued pretraining; section 3.2: WSD, 1-sqrt decay to 10% of the peak
    "cpt": {
        "8b": {"seq": 8192, "batch": 1024, "tp": 2, "pp": None, "vpp": None, "peak": 1.1e-4, "min": 1.1e-5,
               "warmup_iterations": 500},
        "70b": {"seq": 8192, "batch": 2048, "tp": 4, "pp": 8, "vpp": 2, "peak": 2e-5, "min": 2e-6,
                "warmup_iterations": 250},
    },
    # section 3.3 and Appendix G: 32,768 / 65,536 / 131,072 / 262,144 tokens, "RoPE base grows to 2M for the first
    # step and 4M thereafter, with scaling factors of 8, 8, 16, and 32"; "global batch size halves with each
    # doubling of the sequence length (256, 128, 64, and 32 for the 8B model)"; "context parallelism scales as 2,
    # 4, 8, and 16 for the 8B model and 4, 8, 16, and 32 for the 70B model"; "token budgets per step are 62.9B,
    # 58.7B, 58.7B, and 58.7B for the 8B model, and 58.7B, 58.7B, 50.3B, and 50.3B for the 70B model"; a fresh
    # optimizer state at each step; "constant learning rate equal to the main run's minimum". The 70B batches are
    # not listed: section 3.3's rule, "we halve the number of sequences per batch so that the total number of
    # tokens per batch remains constant", applied to Table G.1's 2,048 x 8,192 gives 512, 256, 128, 64 (and whole
    # iteration counts for its token budgets: 3,500, 3,500, 3,000, 3,000). Section 3.4: "During the 70B
    # long-context extension, virtual pipelining halves throughput, so we disable it for that stage."
    # Section 3.2 / Table 2: stages after the first predict text only.
    "long_context": {
        "steps": [("32k", 32768, 2_000_000, 8), ("64k", 65536, 4_000_000, 8), ("128k", 131072, 4_000_000, 16),
                  ("256k", 262144, 4_000_000, 32)],
        "8b": {"batch": [256, 128, 64, 32], "cp": [2, 4, 8, 16], "tokens": [62.9e9, 58.7e9, 58.7e9, 58.7e9]},
        "70b": {"batch": [512, 256, 128, 64], "cp": [4, 8, 16, 32], "tokens": [58.7e9, 58.7e9, 50.3e9, 50.3e9]},
    },
    # section 4.2: "constant learning rate after 800 warmup iterations and a sequence length of 16,384 tokens:
    # Apertus 1.5 8B trains at 6e-5 with a global batch size of 256 ... 70B at 1e-5 with a global batch size of
    # 1,024"; Appendix G: "Adam (beta1 = 0.9, beta2 = 0.999) with no weight decay and gradient clipping at 1.0"
    "sft": {"seq": 16384, "warmup": 800, "adam": (0.9, 0.999), "clip": 1.0,
            "8b": {"lr": 6e-5, "batch": 256}, "70b": {"lr": 1e-5, "batch": 1024}},
    # section 4.3: "at the full sequence length of 262,144 tokens ... Each model keeps its production SFT learning
    # rate, held constant: 6e-5 for Apertus 1.5 8B and 1e-5 for Apertus 1.5 70B, after 195 and 100 warmup steps and
    # at global batch sizes of 32 and 64 sequences". No parallelism is given for it: derived, the 262,144-token
    # extension step's (TP, PP, CP), with packed sequences.
    "long_context_sft": {"seq": 262144, "rope": (4_000_000, 32), "8b": {"warmup": 195, "batch": 32},
                         "70b": {"warmup": 100, "batch": 64}},
}


def as_dict(argv: list[str]) -> dict[str, list[str]]:
    return {g[0]: g[1:] for g in split_flags(argv)}


def _num(x: float) -> str:
    return f"{x:g}"


def _parallel(size: str, *, virtual: bool) -> dict[str, list[str]]:
    c = REPORT["cpt"][size]
    out = {"--tensor-model-parallel-size": [str(c["tp"])]}
    if c["pp"]:
        out["--pipeline-model-parallel-size"] = [str(c["pp"])]
    if c["vpp"] and virtual:
        out["--num-virtual-stages-per-pipeline-rank"] = [str(c["vpp"])]
    return out


def _ademamix() -> dict[str, list[str]]:
    a = REPORT["ademamix"]
    return {"--optimizer": ["adam"], "--apertus-optimizer": ["ademamix"], "--adam-beta1": [_num(a["beta1"])],
            "--adam-beta2": [_num(a["beta2"])], "--apertus-ademamix-beta3": [_num(a["beta3"])],
            "--apertus-ademamix-alpha": [_num(a["alpha"])], "--apertus-ademamix-alpha-warmup": [str(a["alpha_warmup"])],
            "--apertus-ademamix-beta3-warmup": [str(a["beta3_warmup"])], "--weight-decay": [_num(REPORT["weight_decay"])],
            "--apertus-weight-decay-on": ["all"], "--clip-grad": [_num(REPORT["clip"])]}


def _rope(base: int, factor: int, length: int) -> dict[str, list[str]]:
    return {"--max-position-embeddings": [str(length)], "--position-embedding-type": ["rope"],
            "--rotary-base": [str(base)], "--use-rope-scaling": [], "--rope-scaling-factor": [str(factor)]}


def _goldfish() -> dict[str, list[str]]:
    return {"--apertus-goldfish-k": [str(REPORT["goldfish"]["k"])], "--apertus-goldfish-h": [str(REPORT["goldfish"]["h"])]}


def expected_flags() -> dict[str, dict[str, list[str]]]:
    """Every shipped recipe's flags, from :data:`REPORT` (values only; a budget in tokens is checked apart)."""
    out: dict[str, dict[str, list[str]]] = {}
    for size in ("8b", "70b"):
        c = REPORT["cpt"][size]
        out[f"cpt-{size}"] = {
            **_ademamix(), "--lr": [_num(c["peak"])], "--min-lr": [_num(c["min"])], "--lr-decay-style": ["WSD"],
            "--lr-wsd-decay-style": ["minus_sqrt"], "--lr-warmup-samples": [str(c["warmup_iterations"] * c["batch"])],
            "--global-batch-size": [str(c["batch"])], **_parallel(size, virtual=True), "--seq-length": [str(c["seq"])],
            **_rope(*REPORT["main_rope"], c["seq"]), **_goldfish()}
        lc = REPORT["long_context"][size]
        for k, (name, length, base, factor) in enumerate(REPORT["long_context"]["steps"]):
            out[f"long-context-{size}-{name}"] = {
                **_ademamix(), "--lr": [_num(c["min"])], "--min-lr": [_num(c["min"])], "--lr-decay-style": ["constant"],
                "--lr-warmup-samples": ["0"], "--global-batch-size": [str(lc["batch"][k])],
                "--micro-batch-size": ["1"],  # derived: packed sequences (THD) take one sample per micro-batch
                **_parallel(size, virtual=False), "--context-parallel-size": [str(lc["cp"][k])],
                "--seq-length": [str(length)], **_rope(base, factor, length),
                "--train-samples": None,  # the token budget: checked against lc["tokens"] below
                "--apertus-stage": ["long-context"],  # section 3.3: the long-context steps continue stage 3
                "--apertus-targets": ["text-only"], **_goldfish(), "--apertus-packed-sequences": [],
                "--apertus-allow-rope-change": []}
        s = REPORT["sft"]
        adam = {"--optimizer": ["adam"], "--apertus-optimizer": ["megatron"], "--adam-beta1": [_num(s["adam"][0])],
                "--adam-beta2": [_num(s["adam"][1])], "--weight-decay": ["0"], "--clip-grad": [_num(s["clip"])],
                "--lr": [_num(s[size]["lr"])], "--lr-decay-style": ["constant"]}
        out[f"sft-{size}"] = {**adam, "--lr-warmup-iters": [str(s["warmup"])], "--seq-length": [str(s["seq"])],
                              "--global-batch-size": [str(s[size]["batch"])]}
        ls = REPORT["long_context_sft"]
        out[f"long-context-sft-{size}"] = {
            **adam, "--lr-warmup-iters": [str(ls[size]["warmup"])], "--global-batch-size": [str(ls[size]["batch"])],
            "--micro-batch-size": ["1"], **_parallel(size, virtual=False),
            "--context-parallel-size": [str(REPORT["long_context"][size]["cp"][-1])],  # derived (see REPORT)
            "--seq-length": [str(ls["seq"])], **_rope(*ls["rope"], ls["seq"]), "--apertus-packed-sequences": []}
    out["goldfish"] = _goldfish()
    return out


def _same(got: list[str], want: list[str]) -> bool:
    """Flag values equal as numbers where they are numbers (``1.0`` is ``1``), else as text."""
    def norm(v: str) -> Any:
        try:
            return float(v)
        except ValueError:
            return v
    return [norm(v) for v in got] == [norm(v) for v in want]


def test_every_recipe_value_is_the_reports() -> None:
    want = expected_flags()
    assert set(RECIPES) == set(want)
    for name, recipe in RECIPES.items():
        got = as_dict(list(recipe.flags))
        assert len(got) == len(split_flags(list(recipe.flags))), f"{name}: a flag appears twice"
        assert set(got) == set(want[name]), (name, sorted(set(got) ^ set(want[name])))
        for flag, value in want[name].items():
            if value is not None:
                assert _same(got[flag], value), (name, flag, got[flag], value)
    # the long-context token budgets: whole global batches, the report's figure to its precision (0.1B)
    for size in ("8b", "70b"):
        lc = REPORT["long_context"][size]
        for k, (name, length, _, _) in enumerate(REPORT["long_context"]["steps"]):
            f = as_dict(list(RECIPES[f"long-context-{size}-{name}"].flags))
            samples, batch = int(f["--train-samples"][0]), int(f["--global-batch-size"][0])
            assert samples % batch == 0
            assert abs(samples * length - lc["tokens"][k]) <= 0.05e9, (size, name, samples * length)
            # section 3.3: the tokens per batch stay those of the main run
            assert batch * length == REPORT["cpt"][size]["batch"] * REPORT["cpt"][size]["seq"]
    # a fresh optimizer at each long-context step comes from Megatron's --pretrained-checkpoint (the previous step)
    for name, recipe in RECIPES.items():
        if name.startswith("long-context-"):
            assert "--pretrained-checkpoint" in recipe.needs and "--finetune" not in recipe.flags, name
            assert "--no-load-optim" not in recipe.flags  # a restart within the step keeps its optimizer


def test_recipe_needs_and_overrides_are_reported() -> None:
    argv, report = expand_recipes(["--apertus-recipe", "cpt-8b", "--num-layers", "2"])
    f = as_dict(argv)
    assert f["--lr-warmup-samples"] == ["512000"] and argv[-2:] == ["--num-layers", "2"]
    assert "--apertus-recipe" not in argv and "pass as well: --train-samples --lr-wsd-decay-samples --apertus-stage" in report[0]
    argv, report = expand_recipes(["--apertus-recipe", "long-context-70b-256k", "--apertus-bfd-data", "p",
                                   "--context-parallel-size", "64"])
    f = as_dict(argv)
    assert f["--context-parallel-size"] == ["64"] and argv.count("--context-parallel-size") == 1
    assert "--num-virtual-stages-per-pipeline-rank" not in f
    assert "overridden: --context-parallel-size" in report[0] and "pass as well: --pretrained-checkpoint" in report[0]
    assert "recipe long-context-sft-8b" in expand_recipes(["--apertus-recipe", "long-context-sft-8b"])[1][0]
    assert math.isclose(float(as_dict(list(RECIPES["long-context-sft-8b"].flags))["--lr"][0]),
                        float(as_dict(list(RECIPES["sft-8b"].flags))["--lr"][0]))


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
