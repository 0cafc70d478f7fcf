"""The first step of a batch: its line of the plan, and the done check (a committed batch is not redone)."""

from __future__ import annotations

from typing import Any

from .. import storage
from ..plan import BatchRef, batch_items
from .context import RunContext
from .records import Decoded

__all__ = ["ReadBatch"]


class ReadBatch:
    """A batch's items, from its own line of the plan (nothing else of the plan is read)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def done(self, ref: BatchRef) -> dict[str, Any] | None:
        """The record of a batch that was committed (by this run or an earlier one), else ``None``."""
        where = self.ctx.layout.record(ref.part, ref.id)
        return storage.read_json(where) if storage.isfile(where) else None

    def __call__(self, ref: BatchRef) -> Decoded:
        """The batch's items, and what it read so far (its plan line)."""
        items, _shape = batch_items(self.ctx.layout, ref)
        out = Decoded(ref, items)
        out.read = {"plan": [self.ctx.layout.part_batches(ref.part), ref.offset, ref.length], "media": []}
        return out
