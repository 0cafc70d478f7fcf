"""The deterministic plan: which items go into which batch, in which order.

The plan is computed from headers only (:mod:`.sources`) and depends on nothing but the inputs
and the output-deciding settings, never on the worker count or on scheduling. It is written once
to the work directory (:meth:`Plan.save`); a resumed run reads it back instead of scanning again,
after checking that the settings and every input file (size and modification time) are unchanged.

Pretraining: the items are cut into windows of ``window`` consecutive source items; inside a
window they are grouped by modality and exact post-preprocessing shape (groups in sorted shape
order, items in source order), and each group is cut into batches of at most ``batch_size``
items and ``batch_codes`` codes. Every batch is shape-uniform, so the encoders batch it without
padding. The output is written in plan order (batch by batch).

SFT: consecutive conversations form a batch (at most ``batch_size`` of them and ``batch_codes``
media codes); inside a batch the media of all conversations are encoded in shape-uniform groups.
The output is in source order.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .sources import Item, Skip

__all__ = ["PLAN_FORMAT", "Batch", "Plan", "batch_items", "make_batches", "save_json", "load_json"]

PLAN_FORMAT = "apertus-tokenize-plan"


@dataclass
class Batch:
    """A unit of work: item indices in output order, the shared shape (pretraining), its codes and
    where its items are stored (byte offset of its line in ``batches.jsonl``)."""

    id: int
    items: list[int]
    shape: list[Any] | None
    codes: int
    offset: int = -1


@dataclass
class Plan:
    """The plan as the driver and the workers hold it: batches, not the items themselves.

    On disk, in the work directory: ``batches.jsonl`` (one line per batch with its items, read by
    a worker for its batch alone), ``inputs.json`` (size and modification time of every input
    file), and ``plan.json`` (fingerprint, plan-time skips, the batches), written last: a plan
    exists when ``plan.json`` does.
    """

    fingerprint: dict[str, Any]
    inputs: list[list[Any]]
    skipped: list[Skip]
    batches: list[Batch] = field(default_factory=list)
    total_items: int = 0

    @property
    def planned_items(self) -> int:
        return sum(len(b.items) for b in self.batches)

    def save(self, work: Path, items: list[Item]) -> None:
        """Write the plan into ``work`` (see the class docstring); fills each batch's ``offset``."""
        work.mkdir(parents=True, exist_ok=True)
        tmp = work / "batches.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            for b in self.batches:
                b.offset = fh.tell()
                fh.write(json.dumps({"id": b.id, "items": [items[i].to_dict() for i in b.items]},
                                    ensure_ascii=True, separators=(",", ":")) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, work / "batches.jsonl")
        save_json(work / "inputs.json", self.inputs)
        save_json(work / "plan.json", {
            "format": PLAN_FORMAT,
            "version": 1,
            "fingerprint": self.fingerprint,
            "total_items": self.total_items,
            "skipped": [asdict(s) for s in self.skipped],
            "batches": [asdict(b) for b in self.batches],
        })

    @classmethod
    def load(cls, work: Path) -> Plan:
        where = work / "plan.json"
        d = load_json(where)
        if d.get("format") != PLAN_FORMAT or d.get("version") != 1:
            raise ValueError(f"{where}: not a version-1 {PLAN_FORMAT} file")
        return cls(
            fingerprint=d["fingerprint"],
            inputs=load_json(work / "inputs.json"),
            skipped=[Skip(**s) for s in d["skipped"]],
            batches=[Batch(**b) for b in d["batches"]],
            total_items=d["total_items"],
        )


def batch_items(work: Path, batch: Batch) -> list[Item]:
    """The items of one batch, read from its line of ``batches.jsonl``."""
    with open(work / "batches.jsonl", "rb") as fh:
        fh.seek(batch.offset)
        d = json.loads(fh.readline())
    if d.get("id") != batch.id:
        raise ValueError(f"{work / 'batches.jsonl'}: the line at byte {batch.offset} is not batch {batch.id}")
    return [Item.from_dict(i) for i in d["items"]]


def _cut(indices: list[int], items: list[Item], batch_size: int, batch_codes: int,
         shape: list[Any] | None, out: list[Batch]) -> None:
    cur: list[int] = []
    codes = 0
    for i in indices:
        c = items[i].codes
        if cur and (len(cur) >= batch_size or codes + c > batch_codes):
            out.append(Batch(len(out), cur, shape, codes))
            cur, codes = [], 0
        cur.append(i)
        codes += c
    if cur:
        out.append(Batch(len(out), cur, shape, codes))


def make_batches(items: list[Item], kind: str, batch_size: int, batch_codes: int, window: int) -> list[Batch]:
    """The batches of a plan (see the module docstring for the rules)."""
    out: list[Batch] = []
    if kind == "sft":
        _cut([i.index for i in items], items, batch_size, batch_codes, None, out)
        return out
    for w in range(0, len(items), window):
        groups: dict[tuple[Any, ...], list[int]] = {}
        for it in items[w : w + window]:
            ref = it.media[0]
            groups.setdefault((ref.kind, tuple(ref.shape)), []).append(it.index)
        for (kind_, shape), idx in sorted(groups.items()):
            _cut(idx, items, batch_size, batch_codes, [kind_, list(shape)], out)
    return out


def save_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary file in the same folder, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, ensure_ascii=False, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
