"""``apertus tokenize longcontext``: the synthetic long-context tasks written as Megatron indexed datasets.

Reads source documents from JSONL files (one JSON object per line, its text under a key, ``text``
by default), streams them through :class:`apertus_plugins.core.longcontext.LongContextTasks` and
writes, as each example is made:

* ``PREFIX.bin/.idx``: one example (a tokenized conversation) per sequence, the SFT layout: name
  the prefix in ``--apertus-sft-data`` and the SFT mask derived from the ids trains the answers
  only;
* ``PREFIX.mask.bin/.idx``: the token-aligned loss mask (uint8), for ``--apertus-sft-mask stored``;
* ``PREFIX.examples.jsonl``: per example its task, bucket, source document, length, trained
  tokens and the facts its answers state;
* ``PREFIX.report.json`` (counts, tokens and shares per task and bucket, skipped documents by
  reason with their names) and ``PREFIX.manifest.json`` (both datasets).

A bad record (not JSON, not an object, no text under the key, a line longer than
``max_line_bytes``) or an unusable document (empty, shorter than a quarter of the target, longer
than the target, too few countable words) is skipped, named (``FILE:LINE``) on the log and in the
report, and counted by reason; it costs only itself.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from apertus_plugins.core.longcontext import TASKS, Example, LongContextTasks, Skip
from apertus_plugins.infra.files import write_text_atomic

from .indexed import IndexedDatasetWriter, optimal_dtype
from .manifest import write_manifest

__all__ = ["read_documents", "write_long_context", "BAD_RECORD", "MAX_NAMES"]

_LOG = logging.getLogger(__name__)

#: Skip reason of a record that holds no usable text.
BAD_RECORD = "bad-record"
#: Names kept per skip reason in the report (all are logged).
MAX_NAMES = 1000


def read_documents(paths: Iterable[str | os.PathLike[str]], *, text_key: str = "text",
                   max_line_bytes: int = 1 << 28) -> Iterator[tuple[str, str] | Skip]:
    """``(FILE:LINE, text)`` of every record, one line in memory at a time; a :class:`Skip` for a bad one."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such JSONL file")
        with open(path, "rb") as fh:
            line_no = 0
            while True:
                raw = fh.readline(max_line_bytes + 1)
                if not raw:
                    break
                line_no += 1
                name = f"{path}:{line_no}"
                if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                    while raw and not raw.endswith(b"\n"):  # drain the rest of the line, a bounded piece at a time
                        raw = fh.readline(max_line_bytes + 1)
                    yield Skip(name, BAD_RECORD, f"a line longer than {max_line_bytes} bytes")
                    continue
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    yield Skip(name, BAD_RECORD, f"not JSON ({exc})")
                    continue
                text = record.get(text_key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    what = "not a JSON object" if not isinstance(record, dict) else \
                        f"no string under {text_key!r}" if text_key in record else f"no {text_key!r} key"
                    yield Skip(name, BAD_RECORD, what)
                    continue
                yield name, text


def write_long_context(sources: Iterable[str | os.PathLike[str]], out: str | os.PathLike[str], chat: Any, *,
                       length: int, mix: Mapping[str, float], seed: int = 0, max_tokens: int | None = None,
                       max_examples: int | None = None, text_key: str = "text",
                       describe: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Generate and write the tasks (see the module docstring); returns the report."""
    out = os.fspath(out)
    sources = [Path(p) for p in sources]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"no such JSONL file: {', '.join(missing)}")
    gen = LongContextTasks(chat, length, mix, seed)
    if not sources and gen.mix["cwe"] + gen.mix["docorder"] > 0:
        raise ValueError("CWE and DocOrder need source documents: give JSONL files, or a needles-only --mix")
    dtype = optimal_dtype(gen.spec.size)
    skipped: Counter[str] = Counter()
    names: dict[str, list[str]] = {}
    buckets: Counter[str] = Counter()
    trained = dict.fromkeys(TASKS, 0)
    longest, shortest = 0, None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    records_tmp = Path(f"{out}.examples.jsonl.tmp{os.getpid()}")
    try:
        with IndexedDatasetWriter(out, dtype) as tokens, IndexedDatasetWriter(out + ".mask", np.uint8) as masks, \
                open(records_tmp, "w", encoding="utf-8") as records:
            docs = read_documents(sources, text_key=text_key)
            for item in gen.run(docs, max_tokens=max_tokens, max_examples=max_examples):
                if isinstance(item, Skip):
                    _LOG.warning("%s", item)
                    skipped[item.reason] += 1
                    kept = names.setdefault(item.reason, [])
                    if len(kept) < MAX_NAMES:
                        kept.append(f"{item.source}: {item.detail}")
                    continue
                ex: Example = item
                tokens.add_document(ex.ids)
                masks.add_document(ex.mask)
                records.write(json.dumps(ex.record()) + "\n")
                buckets[f"{ex.task}/{ex.bucket}" if ex.bucket else ex.task] += 1
                trained[ex.task] += int(ex.mask.sum())
                longest = max(longest, int(ex.ids.size))
                shortest = int(ex.ids.size) if shortest is None else min(shortest, int(ex.ids.size))
    except BaseException:
        records_tmp.unlink(missing_ok=True)  # the datasets' writers removed their own temporary files
        raise
    os.replace(records_tmp, f"{out}.examples.jsonl")
    total = sum(gen.tokens.values())
    report = {
        "prefix": out, "mask_prefix": out + ".mask", "length": gen.length, "seed": gen.seed,
        "mix": gen.mix, **({"describe": dict(describe)} if describe else {}),
        "examples": dict(gen.examples), "buckets": dict(buckets), "tokens": dict(gen.tokens),
        "shares": {t: (v / total if total else 0.0) for t, v in gen.tokens.items()},
        "trained_tokens": trained, "shortest": shortest, "longest": longest,
        "skipped": dict(skipped), "skipped_names": names,
    }
    write_manifest([out, out + ".mask"], f"{out}.manifest.json",
                   {out: {"kind": "sft", "synthetic": "long-context", "length": gen.length, "seed": gen.seed}})
    write_text_atomic(f"{out}.report.json", json.dumps(report, indent=2) + "\n")
    return report
