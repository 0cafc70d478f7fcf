"""The Apertus training stages (SPEC.md section 6, report Appendix G) as Megatron flags: ``apertus-megatron SCRIPT --apertus-recipe NAME``.

A recipe is a list of Megatron and ``--apertus-*`` flags that the launcher puts before the
command line's own: a flag given on the command line replaces the recipe's (the recipe's value
is dropped, whatever its position), so ``--apertus-recipe cpt-8b --lr 5e-5`` runs the 8B recipe
at another peak learning rate. Several recipes may be named (``--apertus-recipe cpt-8b
--apertus-recipe goldfish``); a later one replaces an earlier one's flags the same way. A NAME
that is a file is read as a flag file (flags separated by white space or lines, ``#`` comments,
shell quoting). The launcher prints each recipe's flags, which the command line overrode, and
which flags the stage still needs, at start.

Shipped recipes (``apertus-megatron --recipes`` lists them); every number is the report's
(``tests/megatron/test_recipes.py`` compares each one with a table written from it):

* ``cpt-8b``, ``cpt-70b`` (Table G.1, section 3.2): continued pretraining with AdEMAMix (the core's
  :data:`megatron_patches.ademamix.RECIPE`: betas, alpha, warmups, weight decay 0.1 on every
  parameter, norm gains and xIELU scalars included), gradient clipping 0.1, a WSD schedule with a
  1-sqrt decay to 10 % of the peak, warm-up 500 (8B) / 250 (70B) iterations of the recipe's
  global batch (512,000 samples of 8,192 tokens: the 4.2B tokens of section 3.2), sequence
  8,192, RoPE base 500,000 with llama3 factor 8 (Apertus 1.0's, section 3.3), Goldfish k = h = 50
  (section 3.2); 8B: peak 1.1e-4, global batch 1,024, TP 2; 70B: peak 2e-5, global batch 2,048,
  TP 4, PP 8, two virtual stages per pipeline rank. The stage lengths are the run's: pass
  ``--train-samples``, ``--lr-wsd-decay-samples`` (stage 3's length) and ``--apertus-stage 1``, ``2`` or
  ``3``: the stage sets the report's targets (stage 1 all modalities, stages 2 and 3 text only); an
  ``--apertus-targets`` that contradicts the stage runs as asked and is logged once.
* ``long-context-{8b,70b}-{32k,64k,128k,256k}`` (section 3.3, Appendix G): the four
  context-extension steps. Each loads the previous step's checkpoint with a fresh optimizer:
  pass it as ``--pretrained-checkpoint`` (Megatron loads it as a finetuning start, optimizer,
  scheduler and iteration fresh, while ``--load`` of this step holds no checkpoint; a restart of
  the step resumes from ``--load`` as usual). Constant learning rate at the main run's minimum,
  RoPE base 2M at 32k and 4M from 64k on with llama3 factors 8, 8, 16, 32, the global batch
  halved at each doubling of the sequence (8B: 256, 128, 64, 32; 70B: 512, 256, 128, 64, the
  same tokens per batch as its main run), context parallelism 2, 4, 8, 16 (8B) and 4, 8, 16,
  32 (70B), the 70B without virtual pipeline stages (section 3.4), the token budget of each step
  as ``--train-samples`` (8B: 62.9B, 58.7B, 58.7B, 58.7B; 70B: 58.7B, 58.7B, 50.3B, 50.3B),
  ``--apertus-stage long-context`` with text-only targets and Goldfish as in the stages before. Documents are packed
  best-fit-decreasing with cross-document masking under context parallelism: name the step's
  prefixes in ``--apertus-bfd-data``; ``--apertus-packed-sequences`` and micro batch 1 are set.
* ``sft-8b``, ``sft-70b`` (section 4.2, Appendix G): Adam (0.9, 0.999), no weight decay, clipping
  1.0, constant learning rate after 800 warm-up iterations, sequence 16,384; 8B: 6e-5, batch 256;
  70B: 1e-5, batch 1,024.
* ``long-context-sft-8b``, ``long-context-sft-70b`` (section 4.3): the production SFT's optimizer
  and learning rate, held constant after 195 (8B) / 100 (70B) warm-up steps, sequences of
  262,144 tokens, global batch 32 / 64. The report gives no parallelism for this stage; the
  recipes use the 262,144-token extension step's (8B: TP 2, CP 16; 70B: TP 4, PP 8, CP 32) with
  packed sequences.
* ``goldfish``: Goldfish loss with the core's defaults (k = 50, h = 50).

Nothing here imports Megatron.
"""

from __future__ import annotations

import inspect
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from apertus_plugins.core.goldfish import goldfish_drop
from apertus_plugins.core.release import CONTEXT_LENGTH, ROPE_FACTOR, ROPE_THETA

from .ademamix import RECIPE as ADEMAMIX
from .errors import ApertusArgumentError

__all__ = ["Recipe", "RECIPES", "MAIN_SEQUENCE", "expand_recipes", "recipe_flags", "split_flags"]

#: The continued-pretraining sequence of both models (Table G.1).
MAIN_SEQUENCE = 8192


@dataclass(frozen=True)
class Recipe:
    """Flags of one stage; ``derived`` flags are computed from the merged command line (e.g. tokens -> samples)."""

    name: str
    summary: str
    flags: tuple[str, ...]
    derived: dict[str, Callable[[dict[str, list[str]]], str | None]] = field(default_factory=dict)
    needs: tuple[str, ...] = ()


def _g(x: float) -> str:
    return f"{x:g}"


def _goldfish() -> list[str]:
    params = inspect.signature(goldfish_drop).parameters
    return ["--apertus-goldfish-k", str(params["k"].default), "--apertus-goldfish-h", str(params["h"].default)]


def _ademamix() -> list[str]:
    b1, b2, b3 = ADEMAMIX["betas"]
    return ["--optimizer", "adam", "--apertus-optimizer", "ademamix", "--adam-beta1", _g(b1), "--adam-beta2", _g(b2),
            "--apertus-ademamix-beta3", _g(b3), "--apertus-ademamix-alpha", _g(ADEMAMIX["alpha"]),
            "--apertus-ademamix-alpha-warmup", str(ADEMAMIX["alpha_warmup"]),
            "--apertus-ademamix-beta3-warmup", str(ADEMAMIX["beta3_warmup"]),
            "--weight-decay", _g(ADEMAMIX["weight_decay"]), "--apertus-weight-decay-on", "all", "--clip-grad", "0.1"]


def _rope(base: int, factor: int, length: int) -> list[str]:
    return ["--max-position-embeddings", str(length), "--position-embedding-type", "rope", "--rotary-base", str(base),
            "--use-rope-scaling", "--rope-scaling-factor", str(factor)]


@dataclass(frozen=True)
class _Model:
    """One model's continued-pretraining numbers (Table G.1) and its long-context steps (Appendix G)."""

    peak: float
    batch: int
    warmup_iterations: int
    parallel: tuple[str, ...]
    virtual_stages: int | None
    long_context_cp: tuple[int, int, int, int]
    long_context_tokens: tuple[float, float, float, float]


_MODELS = {
    "8b": _Model(1.1e-4, 1024, 500, ("--tensor-model-parallel-size", "2"), None, (2, 4, 8, 16),
                 (62.9e9, 58.7e9, 58.7e9, 58.7e9)),
    "70b": _Model(2e-5, 2048, 250, ("--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "8"), 2,
                  (4, 8, 16, 32), (58.7e9, 58.7e9, 50.3e9, 50.3e9)),
}
#: RoPE of the main run (Apertus 1.0's, section 3.3).
_MAIN_ROPE = (500_000, 8)
#: Context-extension steps: (name, sequence, RoPE base, llama3 factor).
_LONG_CONTEXT = (("32k", 32768, 2_000_000, 8), ("64k", 65536, int(ROPE_THETA), 8),
                 ("128k", 131072, int(ROPE_THETA), 16), ("256k", CONTEXT_LENGTH, int(ROPE_THETA), int(ROPE_FACTOR)))
#: SFT (section 4.2): learning rate, global batch; long-context SFT (section 4.3): warm-up steps, global batch.
_SFT = {"8b": (6e-5, 256), "70b": (1e-5, 1024)}
_SFT_SEQ = 16384
_SFT_WARMUP = 800
_LONG_SFT = {"8b": (195, 32), "70b": (100, 64)}


def _samples(tokens: float, length: int, batch: int) -> int:
    """The step's token budget as samples: whole global batches of ``length`` tokens, nearest to ``tokens``."""
    return round(tokens / (length * batch)) * batch


def _adam_sft(lr: float) -> list[str]:
    return ["--optimizer", "adam", "--apertus-optimizer", "megatron", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
            "--weight-decay", "0", "--clip-grad", "1.0", "--lr", _g(lr), "--lr-decay-style", "constant"]


def _build() -> dict[str, Recipe]:
    out: dict[str, Recipe] = {}
    for size, m in _MODELS.items():
        virtual = ["--num-virtual-stages-per-pipeline-rank", str(m.virtual_stages)] if m.virtual_stages else []
        flags = [*_ademamix(), "--lr", _g(m.peak), "--min-lr", _g(m.peak / 10), "--lr-decay-style", "WSD",
                 "--lr-wsd-decay-style", "minus_sqrt", "--lr-warmup-samples", str(m.warmup_iterations * m.batch),
                 "--global-batch-size", str(m.batch), *m.parallel, *virtual, "--seq-length", str(MAIN_SEQUENCE),
                 *_rope(*_MAIN_ROPE, MAIN_SEQUENCE), *_goldfish()]
        out[f"cpt-{size}"] = Recipe(
            f"cpt-{size}", f"continued pretraining {size.upper()}: AdEMAMix, WSD with 1-sqrt decay to 10%, "
            f"warm-up {m.warmup_iterations} iterations", tuple(flags),
            needs=("--train-samples", "--lr-wsd-decay-samples", "--apertus-stage"))
        tokens_per_batch = m.batch * MAIN_SEQUENCE
        for (name, length, base, factor), cp, budget in zip(_LONG_CONTEXT, m.long_context_cp, m.long_context_tokens,
                                                             strict=True):
            b = tokens_per_batch // length  # halved at each doubling: the same tokens per batch
            lc = [*_ademamix(), "--lr", _g(m.peak / 10), "--min-lr", _g(m.peak / 10), "--lr-decay-style", "constant",
                  "--lr-warmup-samples", "0", "--global-batch-size", str(b), "--micro-batch-size", "1", *m.parallel,
                  "--context-parallel-size", str(cp), "--seq-length", str(length), *_rope(base, factor, length),
                  "--train-samples", str(_samples(budget, length, b)), "--apertus-stage", "long-context",
                  "--apertus-targets", "text-only",
                  *_goldfish(), "--apertus-packed-sequences", "--apertus-allow-rope-change"]
            out[f"long-context-{size}-{name}"] = Recipe(
                f"long-context-{size}-{name}", f"context extension {size.upper()} to {name}: RoPE base {base:,}, "
                f"factor {factor}, batch {b}, CP {cp}, constant LR {_g(m.peak / 10)}, fresh optimizer", tuple(lc),
                needs=("--apertus-bfd-data", "--pretrained-checkpoint"))
    for size, (lr, batch) in _SFT.items():
        out[f"sft-{size}"] = Recipe(
            f"sft-{size}", f"SFT {size.upper()}: Adam, constant LR {_g(lr)} after {_SFT_WARMUP} warm-up iterations",
            (*_adam_sft(lr), "--lr-warmup-iters", str(_SFT_WARMUP), "--seq-length", str(_SFT_SEQ),
             "--global-batch-size", str(batch)),
            needs=("--apertus-sft-data",))
        warmup, long_batch = _LONG_SFT[size]
        m = _MODELS[size]
        out[f"long-context-sft-{size}"] = Recipe(
            f"long-context-sft-{size}", f"long-context SFT {size.upper()}: sequences of {CONTEXT_LENGTH:,} tokens, "
            f"constant LR {_g(lr)} after {warmup} warm-up iterations, batch {long_batch}",
            (*_adam_sft(lr), "--lr-warmup-iters", str(warmup), "--global-batch-size", str(long_batch),
             "--micro-batch-size", "1", *m.parallel, "--context-parallel-size", str(m.long_context_cp[-1]),
             "--seq-length", str(CONTEXT_LENGTH), *_rope(int(ROPE_THETA), int(ROPE_FACTOR), CONTEXT_LENGTH),
             "--apertus-packed-sequences"),
            needs=("--apertus-sft-data", "--pretrained-checkpoint"))
    out["goldfish"] = Recipe("goldfish", f"Goldfish loss k={_goldfish()[1]} h={_goldfish()[3]}", tuple(_goldfish()))
    return out


RECIPES: dict[str, Recipe] = _build()


def split_flags(argv: Sequence[str]) -> list[list[str]]:
    """``["--a", "1", "--b", "--c", "x", "y"]`` -> ``[["--a", "1"], ["--b"], ["--c", "x", "y"]]`` (values stay with
    their flag; a negative number is a value)."""
    groups: list[list[str]] = []
    for tok in argv:
        if tok.startswith("--") or not groups:
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return groups


def _flag(group: list[str]) -> str:
    return group[0].split("=", 1)[0]


def _load(name: str) -> Recipe:
    if name in RECIPES:
        return RECIPES[name]
    path = Path(name)
    if path.is_file():
        lines = [ln.split("#", 1)[0] for ln in path.read_text(encoding="utf-8").splitlines()]
        flags = shlex.split(" ".join(lines))
        if flags and not flags[0].startswith("--"):
            raise ApertusArgumentError(f"--apertus-recipe {name}: a flag file must start with a --flag, not {flags[0]!r}")
        return Recipe(str(path), f"flag file {path}", tuple(flags))
    raise ApertusArgumentError(f"--apertus-recipe {name}: no such recipe or file; recipes are {', '.join(RECIPES)}")


def recipe_flags(name: str) -> list[str]:
    """The flags of a shipped recipe or flag file (derived flags not included)."""
    return list(_load(name).flags)


def expand_recipes(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Take ``--apertus-recipe NAME`` out of ``argv`` and put each recipe's flags first.

    Returns ``(new argv, report lines)``; a flag on the command line (or in a later recipe)
    replaces the recipe's.
    """
    rest: list[str] = []
    names: list[str] = []
    it = iter(argv)
    for tok in it:
        if tok == "--apertus-recipe":
            value = next(it, None)
            if value is None or value.startswith("--"):
                raise ApertusArgumentError("--apertus-recipe needs a NAME (or a flag file)")
            names.append(value)
        elif tok.startswith("--apertus-recipe="):
            names.append(tok.split("=", 1)[1])
        else:
            rest.append(tok)
    if not names:
        return list(argv), []
    user = split_flags(rest)
    later = {_flag(g) for g in user}
    merged: list[list[str]] = []
    report: list[str] = []
    recipes = [_load(n) for n in names]
    for i, r in enumerate(recipes):
        taken = later | {_flag(g) for other in recipes[i + 1:] for g in split_flags(other.flags)}
        groups = split_flags(r.flags)
        kept = [g for g in groups if _flag(g) not in taken]
        dropped = [_flag(g) for g in groups if _flag(g) in taken]
        merged += kept
        line = f"recipe {r.name} ({r.summary}): {' '.join(' '.join(g) for g in kept)}"
        if dropped:
            line += f" | overridden: {' '.join(dropped)}"
        if r.needs:
            missing = [n for n in r.needs if n not in later]
            if missing:
                line += f" | pass as well: {' '.join(missing)}"
        report.append(line)
    flags = {_flag(g): g[1:] for g in merged + user}
    for r in recipes:
        for name, fn in r.derived.items():
            if name not in flags:
                value = fn(flags)
                if value is None:
                    continue
                merged.append([name, value])
                flags[name] = [value]
                report.append(f"recipe {r.name}: {name} {value} (derived)")
    return [t for g in merged for t in g] + [t for g in user for t in g], report
