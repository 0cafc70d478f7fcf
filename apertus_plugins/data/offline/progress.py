"""The progress view of a long run: items/s, encoder utilisation, skipped items by reason and by name, ETA.

:class:`Progress` follows the encode stage: a tqdm bar in the terminal (rate, ETA, and in its
postfix the encoder utilisation and the skipped items by reason) and the same figures in
``WORK/progress.json``, rewritten every few seconds, for a person or a script watching the job;
the final figures go into the report (``run.progress``). Skipped items are named as they are
found (:class:`Skipped`): the first :data:`SHOWN` above the bar, the latest :data:`SHOWN` in
``progress.json`` (``skipped_latest``), all of them in the report.

Encoder utilisation is the share of the encoder processes' wall time spent in the encoders, from
the moment each loaded its encoders: summed over the encoder processes (Ray actors, or local
workers, which also decode and write), seconds inside encoder calls over seconds since loading.
``encoder_share_of_stage`` divides the same seconds by (encoder processes x the whole encode
stage), start-up included.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from apertus_plugins.data.offline import storage

__all__ = ["Progress", "Skipped", "SHOWN", "bar"]

#: Skipped items named above the bars, and kept by name in ``progress.json``.
SHOWN = 20


def bar(enabled: bool, **kw: Any) -> Any:
    """A tqdm bar on stderr (disabled with ``--no-progress``)."""
    from tqdm import tqdm

    return tqdm(disable=not enabled, dynamic_ncols=True, file=sys.stderr, **kw)


class Skipped:
    """The skipped items of a run as they are found: counted by reason, the latest :data:`SHOWN` kept by
    name, the first :data:`SHOWN` written above ``bar`` (``skip`` dicts: source, reason, detail, stage)."""

    def __init__(self, bar: Any = None, counts: dict[str, int] | None = None, latest: Iterable[dict] = ()) -> None:
        self.bar = bar
        self.counts: Counter[str] = Counter(counts or {})
        self.latest: deque[dict[str, Any]] = deque(latest, maxlen=SHOWN)
        self.shown = 0

    def add(self, skips: Iterable[dict[str, Any]]) -> None:
        for s in skips:
            self.counts[s["reason"]] += 1
            self.latest.append({k: s.get(k, "") for k in ("source", "reason", "detail", "stage")})
            if self.bar is not None and not self.bar.disable and self.shown <= SHOWN:
                self.bar.write(f"skipped ({s['reason']}): {s['detail']}" if self.shown < SHOWN else
                               "... more skipped items are counted on the bar and named in the report", file=sys.stderr)
                self.shown += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items())) or "none"


class Progress:
    """Figures of the encode stage (see the module docstring); ``skipped``: the :class:`Skipped` of the
    plan stage, continued here."""

    def __init__(self, where: str | None, total: int, done: int, encoders: int, enabled: bool,
                 skipped: Skipped | None = None, every: float = 5.0) -> None:
        self.where, self.total, self.initial, self.encoders = where, total, done, max(1, encoders)
        self.items = 0
        self.encode_s = 0.0
        self.busy_s = 0.0
        self.cache: dict[str, int] | None = None  # media-code cache hits and misses, when it is on
        self.clocks: dict[tuple[str, int], tuple[float, float]] = {}  # encoder process -> (busy, uptime)
        self.t0 = time.perf_counter()
        self.every = every
        self._shown = self._saved = 0.0
        self.bar = bar(enabled, desc="encode", unit=" item", total=total, initial=done)
        self.skipped = skipped or Skipped()
        self.skipped.bar = self.bar

    def update(self, record: dict[str, Any], items: int) -> None:
        self.items += items
        self.encode_s += float(record.get("encode_s", 0.0))
        self.busy_s += float(record.get("seconds", 0.0))
        self.skipped.add(record.get("skipped", ()))
        if record.get("media_cache"):
            self.cache = self.cache or {"hits": 0, "misses": 0}
            for k in ("hits", "misses"):
                self.cache[k] += int(record["media_cache"].get(k, 0))
        enc = record.get("encoder") or {}
        if "uptime_s" in enc:
            key = (enc["host"], enc["pid"])
            self.clocks[key] = max(self.clocks.get(key, (0.0, 0.0)), (enc["busy_s"], enc["uptime_s"]),
                                   key=lambda c: c[1])
        self.bar.update(items)
        now = time.perf_counter()
        if now - self._shown >= 1.0:
            self._shown = now
            self.bar.set_postfix_str(self._postfix(), refresh=False)
        if self.where and now - self._saved >= self.every:
            self._saved = now
            storage.write_json(self.where, self.stats())

    def _postfix(self) -> str:
        s = self.stats()
        return f"encoder {s['encoder_utilisation']:.0%}, skipped: {self.skipped.summary()}"

    def stats(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.t0
        rate = self.items / elapsed if elapsed > 0 else 0.0
        left = self.total - self.initial - self.items
        busy = sum(b for b, _u in self.clocks.values())
        up = sum(u for _b, u in self.clocks.values())
        return {
            "items_done": self.initial + self.items,
            "items_total": self.total,
            "items_per_s": round(rate, 2),
            "elapsed_s": round(elapsed, 3),
            "eta_s": round(left / rate, 1) if rate > 0 else None,
            "encoders": self.encoders,
            "encoder_s": round(self.encode_s, 3),
            "encoder_utilisation": round(busy / up, 4) if up > 0 else 0.0,
            "encoder_share_of_stage": round(self.encode_s / (self.encoders * elapsed), 4) if elapsed > 0 else 0.0,
            "encoder_share_of_batch_time": round(self.encode_s / self.busy_s, 4) if self.busy_s > 0 else 0.0,
            "skipped_by_reason": dict(sorted(self.skipped.counts.items())),
            "skipped_latest": list(self.skipped.latest),
            "media_cache": dict(self.cache) if self.cache is not None else None,
        }

    def close(self) -> dict[str, Any]:
        self.bar.set_postfix_str(self._postfix(), refresh=False)
        self.bar.close()
        out = self.stats()
        if self.where:
            storage.write_json(self.where, out)
        return out
