"""The encode step: every modality's preprocessed arrays to codes, in the encoders loaded once per process.

When the encoder raises on a group of arrays, the group is encoded again in halves down to the
arrays it fails on alone (:meth:`Encode.isolated`): only those are left out.
"""

from __future__ import annotations

import time

import numpy as np

from ..faults import worker_info
from .context import RunContext
from .records import Arrays, Encoded

__all__ = ["Encode"]


class Encode:
    """Codes of a batch's arrays, with this process's encoder clock (busy seconds since the first load)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._ready: float | None = None  # when this process's first encoder was loaded
        self._busy = 0.0  # seconds spent in the encoders since

    def __call__(self, arrays: Arrays) -> Encoded:
        encoders = self.ctx.encoders
        kinds = sorted(k for k, (_keys, arr) in arrays.items() if arr)
        t_load = time.perf_counter()
        for kind in kinds:
            encoders.load(kind)
        load_s = time.perf_counter() - t_load
        if kinds and self._ready is None:
            self._ready = time.perf_counter()
        cache = encoders.cache
        before = (cache.hits, cache.misses) if cache is not None else (0, 0)
        t0 = time.perf_counter()
        out = Encoded(load_s=load_s)
        for kind in kinds:
            if kind == "audio" and self.ctx.cfg.audio_batching == "report":
                out.codes[kind], bad = self.padded(arrays[kind][1])
            else:
                out.codes[kind], bad = self.isolated(kind, arrays[kind][1])
            if bad:
                out.failed[kind] = bad
        out.encode_s = time.perf_counter() - t0
        self._busy += out.encode_s
        clock = {"busy_s": round(self._busy, 4),
                 "uptime_s": round(time.perf_counter() - self._ready, 4) if self._ready is not None else 0.0}
        out.device, out.loads, out.encoder = encoders.device, encoders.loads, {**worker_info(), **clock}
        if cache is not None:
            out.media_cache = {"hits": cache.hits - before[0], "misses": cache.misses - before[1]}
        return out

    def padded(self, arrays: list[np.ndarray]) -> tuple[list[np.ndarray | None], dict[int, str]]:
        """Audio codes under the report's batching (:mod:`..batching`): the clips of a pretraining batch are
        one padded batch (the plan made it); the clips of a batch of recordings are first cut into
        duration batches. A padded batch the encoder raises on is encoded in halves (their padding,
        and so the codes near a clip's end, then differ), down to single clips (:meth:`isolated`).
        """
        from ..batching import duration_batches

        cfg = self.ctx.cfg
        if cfg.kind == "pretrain":
            groups = [list(range(len(arrays)))]
        else:
            groups = duration_batches([a.size for a in arrays], cfg.audio_batching_settings(), cfg.batch_size)
        out: list[np.ndarray | None] = [None] * len(arrays)
        failed: dict[int, str] = {}
        for group in groups:
            got, bad = self.isolated("audio", [arrays[i] for i in group], padded=True)
            for j, i in enumerate(group):
                out[i] = got[j]
                if j in bad:
                    failed[i] = bad[j]
        return out, failed

    def isolated(self, kind: str, arrays: list[np.ndarray],
                 padded: bool = False) -> tuple[list[np.ndarray | None], dict[int, str]]:
        """Codes of ``arrays``; when the encoder raises on a group, its halves are encoded apart, down to
        single arrays: an array the encoder fails on alone is left out (``None``, and its error by
        position), every other one is encoded. The encoders never pad, so an array's codes do not
        depend on what it was batched with: the result equals the batched one wherever both exist.
        """
        out: list[np.ndarray | None] = [None] * len(arrays)
        failed: dict[int, str] = {}
        todo = [list(range(len(arrays)))]
        while todo:
            group = todo.pop()
            try:
                got = self.ctx.encoders.encode(kind, [arrays[i] for i in group], padded=padded)
            except Exception as exc:  # noqa: BLE001 (found by bisection; one array's failure costs only it)
                if len(group) == 1:
                    failed[group[0]] = f"{type(exc).__name__}: {exc}"
                else:
                    half = len(group) // 2
                    todo += [group[half:], group[:half]]  # the first half next: errors in input order
                continue
            for i, c in zip(group, got, strict=True):
                out[i] = c
        return out, failed
