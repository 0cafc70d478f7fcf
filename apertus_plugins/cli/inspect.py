"""``apertus inspect PREFIX --index N``: what one document of a Megatron indexed dataset trains.

With ``--json`` prints ``{"ids": [...], "sft_mask": [...], "goldfish_drop": [...]}``; both lists
are indexed by label position ``j`` (label ``j`` is ``ids[j+1]``). Without it prints the tokens,
coloured by role and mask, for a person checking a dataset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..goldfish import VARIANTS, goldfish_drop
from ..indexed import IndexedDataset
from ..targets import sft_mask
from ..vocab import VocabSpec

_RESET = "\033[0m"
_TRAINED = "\033[32m"  # green: a trained label
_DROPPED = "\033[9;33m"  # struck yellow: trained but dropped by Goldfish
_STRUCT = "\033[1;36m"  # bold cyan: structure tokens (not trained)
_MEDIA = "\033[35m"  # magenta: media codes
_PLAIN = "\033[2m"  # dim: context, not trained


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show what one document of an indexed dataset trains",
        description="Read document N of a Megatron indexed dataset (PREFIX.bin/.idx) and show its ids with "
        "the SFT mask and the Goldfish drops, both indexed by label position j (label j is ids[j+1]).",
    )
    p.add_argument("prefix", help="dataset prefix (PREFIX.bin and PREFIX.idx)")
    p.add_argument("--index", type=int, default=0, help="document index (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (layout and decoding); default VocabSpec()")
    p.add_argument("--goldfish-k", type=int, default=50, help="Goldfish k (default 50)")
    p.add_argument("--goldfish-h", type=int, default=50, help="Goldfish h (default 50)")
    p.add_argument("--goldfish-variant", choices=VARIANTS, default="hashtable", help="Goldfish variant")
    p.add_argument("--start-inside", choices=("auto", "none", "assistant", "tool_output"), default="auto",
                   help="SFT state before the first token (default: inferred)")
    p.set_defaults(func=run)


def inspect_document(
    prefix: str, index: int, spec: VocabSpec, *, k: int = 50, h: int = 50, variant: str = "hashtable",
    start_inside: str = "auto",
) -> dict[str, list[int] | list[bool]]:
    """The ``--json`` object for document ``index`` of ``prefix``."""
    ds = IndexedDataset(prefix)
    ids = np.asarray(ds.document(index), dtype=np.int64)
    mask = sft_mask(ids, spec, start_inside=start_inside)  # type: ignore[arg-type]
    drop = goldfish_drop(ids[1:], k=k, h=h, variant=variant, spec=spec)
    return {"ids": ids.tolist(), "sft_mask": mask.tolist(), "goldfish_drop": drop.tolist()}


def run(args: argparse.Namespace) -> int:
    spec = VocabSpec.from_tokenizer_dir(args.tokenizer) if args.tokenizer else VocabSpec()
    out = inspect_document(args.prefix, args.index, spec, k=args.goldfish_k, h=args.goldfish_h,
                           variant=args.goldfish_variant, start_inside=args.start_inside)
    if args.json:
        print(json.dumps(out))
        return 0
    decode = _decoder(args.tokenizer)
    color = sys.stdout.isatty()
    ids, mask, drop = out["ids"], out["sft_mask"], out["goldfish_drop"]
    parts = []
    code_lo = min((m.offset for m in spec.modalities), default=spec.size)
    for p, tid in enumerate(ids):
        trained = p > 0 and bool(mask[p - 1])
        dropped = p > 0 and bool(drop[p - 1])
        name = spec.id_to_name.get(tid)
        if name is not None:
            text, style = f"<|{name}|>" if decode is None else decode(tid), _STRUCT
        elif tid >= code_lo:
            text, style = f"[{spec.modality_names[int(spec.modality_of(tid))]} {tid}]", _MEDIA
        else:
            text, style = (f"{tid} " if decode is None else decode(tid)), _PLAIN
        if trained:
            style = _DROPPED if dropped else _TRAINED
        parts.append(f"{style}{text}{_RESET}" if color else (f"[+{text}]" if trained else text))
    print("".join(parts))
    n = len(mask)
    print(f"\n{len(ids)} tokens, {n} labels: {sum(mask)} trained (SFT mask), {sum(drop)} dropped by Goldfish "
          f"(k={args.goldfish_k}, h={args.goldfish_h}, {args.goldfish_variant})")
    if color:
        print(f"legend: {_TRAINED}trained{_RESET} {_DROPPED}dropped{_RESET} {_STRUCT}structure{_RESET} "
              f"{_MEDIA}media{_RESET} {_PLAIN}context{_RESET}")
    else:
        print("legend: [+...] trained label")
    return 0


def _decoder(tokenizer_dir: str | None):  # type: ignore[no-untyped-def]
    if not tokenizer_dir:
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda tid: tok.decode([tid], skip_special_tokens=False)
