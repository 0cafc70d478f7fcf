"""The Apertus training stages (SPEC.md section 6) as Megatron flags: ``apertus-megatron SCRIPT --apertus-recipe NAME``.

A recipe is a list of Megatron and ``--apertus-*`` flags that the launcher puts before the
command line's own: a flag given on the command line replaces the recipe's (the recipe's value
is dropped, whatever its position), so ``--apertus-recipe cpt-8b --lr 5e-5`` runs the 8B recipe
at another peak learning rate. Several recipes may be named (``--apertus-recipe cpt-8b
--apertus-recipe goldfish``); a later one replaces an earlier one's flags the same way. A NAME
that is a file is read as a flag file (flags separated by white space or lines, ``#`` comments,
shell quoting). The launcher prints each recipe's flags, and which the command line overrode, at
start.

Shipped recipes (``apertus-megatron --recipes`` lists them):

* ``cpt-8b``, ``cpt-70b``: continued pretraining with AdEMAMix (the core's
  :data:`megatron_patches.ademamix.RECIPE`: betas, alpha, warmups, weight decay 0.1 on every
  parameter, norm gains and xIELU scalars included), gradient clipping 0.1, a WSD schedule with a
  1-sqrt decay to 10 % of the peak (warm-up of 4.2B tokens, as samples of the run's
  ``--seq-length``); 8B: peak 1.1e-4, sequence 8,192, global batch 1,024, TP 2; 70B: peak 2e-5,
  global batch 2,048, TP 4, PP 8, two virtual stages per pipeline rank. The stage lengths are the
  run's: pass ``--train-samples`` and ``--lr-wsd-decay-samples`` (stage 3's length).
* ``long-context-{8b,70b}-{32k,64k,128k,256k}``: the context-extension steps, each halving the
  previous step's global batch (the first halves the main run's), RoPE base 2M at 32k and 4M
  from 64k on with llama3 factors 8, 8, 16, 32 (SPEC.md's "base 2M then 4M, factors 8, 8, 16,
  32", read as: the base doubles at the second step, the factor at the third and fourth),
  constant learning rate at the main run's minimum, ``--apertus-allow-rope-change``. Pack the
  stage's prefixes with ``--apertus-bfd-data``.
* ``sft-8b``, ``sft-70b``: Adam (0.9, 0.999), no weight decay, clipping 1.0, constant learning
  rate after 800 warm-up iterations, sequence 16,384; 8B: 6e-5, batch 256; 70B: 1e-5, batch 1,024.
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

__all__ = ["Recipe", "RECIPES", "WARMUP_TOKENS", "expand_recipes", "recipe_flags", "split_flags"]

#: Continued pretraining's learning-rate warm-up (SPEC.md 6), in tokens.
WARMUP_TOKENS = 4_200_000_000


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


def _ademamix() -> list[str]:
    b1, b2, b3 = ADEMAMIX["betas"]
    return ["--optimizer", "adam", "--apertus-optimizer", "ademamix", "--adam-beta1", _g(b1), "--adam-beta2", _g(b2),
            "--apertus-ademamix-beta3", _g(b3), "--apertus-ademamix-alpha", _g(ADEMAMIX["alpha"]),
            "--apertus-ademamix-alpha-warmup", str(ADEMAMIX["alpha_warmup"]),
            "--apertus-ademamix-beta3-warmup", str(ADEMAMIX["beta3_warmup"]),
            "--weight-decay", _g(ADEMAMIX["weight_decay"]), "--apertus-weight-decay-on", "all", "--clip-grad", "0.1"]


def _warmup_samples(flags: dict[str, list[str]]) -> str | None:
    if "--lr-warmup-iters" in flags or "--lr-warmup-fraction" in flags:
        return None  # the run chose its own warm-up
    seq = flags.get("--seq-length")
    if not seq:
        raise ApertusArgumentError(f"the continued-pretraining recipes warm up over {WARMUP_TOKENS:,} tokens, counted in "
                                   "samples of --seq-length: pass --seq-length")
    return str(round(WARMUP_TOKENS / int(seq[0])))


#: (model, peak LR, global batch, parallelism, sequence or None)
_MODELS = {
    "8b": (1.1e-4, 1024, ["--tensor-model-parallel-size", "2"], 8192),
    "70b": (2e-5, 2048, ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "8",
                         "--num-virtual-stages-per-pipeline-rank", "2"], None),
}
#: Context-extension steps: (name, sequence, RoPE base, llama3 factor).
_LONG_CONTEXT = (("32k", 32768, 2_000_000, 8), ("64k", 65536, int(ROPE_THETA), 8),
                 ("128k", 131072, int(ROPE_THETA), 16), ("256k", CONTEXT_LENGTH, int(ROPE_THETA), int(ROPE_FACTOR)))
_SFT = {"8b": (6e-5, 256), "70b": (1e-5, 1024)}
_SFT_SEQ = 16384


def _build() -> dict[str, Recipe]:
    out: dict[str, Recipe] = {}
    for size, (peak, batch, parallel, seq) in _MODELS.items():
        flags = [*_ademamix(), "--lr", _g(peak), "--min-lr", _g(peak / 10), "--lr-decay-style", "WSD",
                 "--lr-wsd-decay-style", "minus_sqrt", "--global-batch-size", str(batch), *parallel]
        if seq:
            flags += ["--seq-length", str(seq)]
        out[f"cpt-{size}"] = Recipe(
            f"cpt-{size}", f"continued pretraining {size.upper()}: AdEMAMix, WSD with 1-sqrt decay to 10%",
            tuple(flags), {"--lr-warmup-samples": _warmup_samples}, needs=("--train-samples", "--lr-wsd-decay-samples"))
        b = batch
        for name, length, base, factor in _LONG_CONTEXT:
            b //= 2
            lc = [*_ademamix(), "--lr", _g(peak / 10), "--min-lr", _g(peak / 10), "--lr-decay-style", "constant",
                  "--lr-warmup-iters", "0", "--global-batch-size", str(b), *parallel, "--seq-length", str(length),
                  "--max-position-embeddings", str(length), "--position-embedding-type", "rope", "--rotary-base",
                  str(base), "--use-rope-scaling", "--rope-scaling-factor", str(factor), "--apertus-allow-rope-change"]
            out[f"long-context-{size}-{name}"] = Recipe(
                f"long-context-{size}-{name}", f"context extension {size.upper()} to {name}: RoPE base {base:,}, "
                f"factor {factor}, batch {b}, constant LR {_g(peak / 10)}", tuple(lc), needs=("--apertus-bfd-data",))
    for size, (lr, batch) in _SFT.items():
        out[f"sft-{size}"] = Recipe(
            f"sft-{size}", f"SFT {size.upper()}: Adam, constant LR {_g(lr)} after 800 warm-up iterations",
            ("--optimizer", "adam", "--apertus-optimizer", "megatron", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
             "--weight-decay", "0", "--clip-grad", "1.0", "--lr", _g(lr), "--lr-decay-style", "constant",
             "--lr-warmup-iters", "800", "--seq-length", str(_SFT_SEQ), "--global-batch-size", str(batch)),
            needs=("--apertus-sft-data",))
    params = inspect.signature(goldfish_drop).parameters
    k, h = params["k"].default, params["h"].default
    out["goldfish"] = Recipe("goldfish", f"Goldfish loss k={k} h={h}",
                             ("--apertus-goldfish-k", str(k), "--apertus-goldfish-h", str(h)))
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
