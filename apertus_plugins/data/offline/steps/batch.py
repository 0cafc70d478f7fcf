"""A batch through its steps: read -> preprocess -> encode -> pack -> write.

:meth:`RunBatch.__call__` runs them in one process. The Ray path runs them in three places
(:meth:`RunBatch.decode` on a CPU task, the encode step on an encoder actor, :meth:`RunBatch.finish`
on a CPU task) with the same records between them. A batch is idempotent: one whose record
exists is not redone. :meth:`RunBatch.careful` runs a batch whose worker process died item by item.
"""

from __future__ import annotations

import time
from typing import Any

from .. import storage
from ..faults import CRASHES
from ..plan import BatchRef
from ..sources import Reasons, Skip
from .context import RunContext
from .encode import Encode
from .pack import Pack
from .preprocess import Preprocess
from .read import ReadBatch
from .records import Decoded, Encoded
from .write import Write

__all__ = ["RunBatch"]


class RunBatch:
    """The steps of a batch, each its own object (the encode step keeps this process's encoder clock)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.read = ReadBatch(ctx)
        self.preprocess = Preprocess(ctx)
        self.encode = Encode(ctx)
        self.pack = Pack(ctx)
        self.write = Write(ctx)

    def done(self, ref: BatchRef) -> dict[str, Any] | None:
        return self.read.done(ref)

    def decode(self, ref: BatchRef) -> Decoded:
        """Read and preprocess: the batch's line of the plan and its media, decoded and resized (CPU)."""
        t0 = time.perf_counter()
        dec = self.read(ref)
        self.preprocess(dec.items, dec)
        dec.decode_s = time.perf_counter() - t0
        return dec

    def finish(self, dec: Decoded, enc: Encoded | None) -> dict[str, Any]:
        """Pack and write: the documents, the batch's shards, its record."""
        enc = enc or Encoded()
        t0 = time.perf_counter()
        packed = self.pack(dec, enc)
        return self.write(dec, enc, packed, time.perf_counter() - t0)

    def __call__(self, ref: BatchRef) -> dict[str, Any]:
        """Every step of one batch in this process (idempotent); its record."""
        done = self.done(ref)
        if done is not None:
            return done
        dec = self.decode(ref)
        return self.finish(dec, self.encode(dec.arrays) if dec.arrays else None)

    def careful(self, ref: BatchRef) -> dict[str, Any]:
        """Run a batch whose worker process died: item by item, each item's index recorded before it is
        decoded and encoded (``WORK/crashes/...``), so an item its worker dies on :data:`CRASHES` times
        (a decoder's crash, the kernel's out-of-memory kill) is found and skipped and the rest of the
        batch is written, with the bytes a plain run gives (the encoders never pad)."""
        done = self.done(ref)
        if done is not None:
            return done
        where = self.ctx.layout.crashes(ref.part, ref.id)
        state = storage.read_json(where) if storage.isfile(where) else {"current": None, "crashes": {}}
        if state["current"] is not None:  # the previous careful attempt's worker died on this item
            key = str(state["current"])
            state["crashes"][key] = state["crashes"].get(key, 0) + 1
            state["current"] = None
        t0 = time.perf_counter()
        dec = self.read(ref)
        enc = Encoded()
        for it in dec.items:
            died = state["crashes"].get(str(it.index), 0)
            if died >= CRASHES:
                dec.skips[it.index] = Skip(it.name, Reasons.CRASH, f"{it.name}: its worker process died {died} times "
                                           "while it was decoded or encoded (a crash in a decoder or the encoder, or "
                                           "out of memory); the rest of its batch is written", "decode")
                continue
            state["current"] = it.index
            storage.write_json(where, state)
            one = Decoded(ref, [it], read=dec.read)
            self.preprocess([it], one)
            dec.skips.update(one.skips)
            dec.conversations.update(one.conversations)
            got = self.encode(one.arrays) if one.arrays else None
            for kind, (keys, _arrays) in one.arrays.items():
                dec.arrays.setdefault(kind, ([], []))[0].extend(keys)
                if got is not None:
                    enc.append(kind, got)
            if got is not None:
                enc.took(got)
        state["current"] = None
        storage.write_json(where, state)
        dec.decode_s = time.perf_counter() - t0 - enc.encode_s
        return self.finish(dec, enc)
