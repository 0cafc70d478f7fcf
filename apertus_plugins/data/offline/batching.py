"""How audio clips share an encoder batch: by exact length (the default) or as the report batches them.

Two audio batchings (``TokenizeConfig.audio_batching``, ``apertus tokenize --audio-batching``):

* ``exact`` (default): clips share a batch only when their 24 kHz sample counts are identical, so
  no clip is padded; every clip keeps all ``ceil(samples / 600)`` codes and its codes equal its
  single-clip encoding (what serving produces). A clip's codes do not depend on which clips share
  its batch, so re-tokenizing a clip, alone or in another mix, gives the same tokens.
* ``report``: the released pipeline's batching (report section 2.3.2): clips are grouped into
  duration buckets, a batch is capped by its total audio duration, each clip is zero-padded to the
  longest of its batch and a padded clip loses its last five codes
  (:func:`apertus_plugins.core.media.audio.padded_code_counts`). This reproduces how the released
  data was made, at the price of codes that depend on the batch.

Buckets here are quantiles of the clip lengths of one planning window (or of one batch of
recordings), so the plan stays a function of the inputs and the settings alone: no sampler
state, no randomness, and a resumed run plans the same batches.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from apertus_plugins.core.media.audio import SAMPLE_RATE

__all__ = ["AUDIO_BATCHINGS", "AudioBatching", "cut_batches", "duration_buckets", "duration_batches"]

#: The audio batchings (see the module docstring); the first is the default.
AUDIO_BATCHINGS = ("exact", "report")


@dataclass(frozen=True)
class AudioBatching:
    """The report batching's settings: duration buckets and the cap on a batch's total audio duration.

    ``max_seconds`` and ``buckets`` default to the released pipeline's sampler settings
    (``max_batch_duration`` 1,500 s, ``num_buckets`` 20); the report states the rule, not the values.
    """

    max_seconds: float = 1500.0
    buckets: int = 20

    def __post_init__(self) -> None:
        if not self.max_seconds > 0:
            raise ValueError(f"audio batch duration must be positive, got {self.max_seconds}")
        if int(self.buckets) < 1:
            raise ValueError(f"audio buckets must be at least 1, got {self.buckets}")

    @property
    def max_samples(self) -> int:
        """The cap on a batch's total 24 kHz samples."""
        return int(self.max_seconds * SAMPLE_RATE)


def duration_buckets(lengths: Sequence[int], buckets: int) -> list[int]:
    """The bucket (0 = shortest) of each clip: ``buckets`` quantile ranges of ``lengths``.

    Clips of equal length always share a bucket; fewer distinct lengths than buckets give fewer
    non-empty buckets.
    """
    if not lengths:
        return []
    ordered = sorted(int(n) for n in lengths)
    k = max(1, min(int(buckets), len(ordered)))
    edges = sorted({ordered[(j * len(ordered)) // k] for j in range(1, k)})
    return [bisect_right(edges, int(n)) for n in lengths]


def duration_batches(lengths: Sequence[int], batching: AudioBatching, batch_size: int) -> list[list[int]]:
    """Positions of ``lengths`` (24 kHz samples per clip) cut into report-style batches.

    Clips are grouped by :func:`duration_buckets`; within a bucket, in input order, a batch takes
    clips while its total duration stays within ``batching.max_samples`` and it holds at most
    ``batch_size`` clips (a clip longer than the cap is a batch of its own). Buckets come out
    shortest first.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    groups: dict[int, list[int]] = {}
    for pos, b in enumerate(duration_buckets(lengths, batching.buckets)):
        groups.setdefault(b, []).append(pos)
    out: list[list[int]] = []
    for b in sorted(groups):
        out += cut_batches(((pos, int(lengths[pos])) for pos in groups[b]), batch_size, batching.max_samples)
    return out


def cut_batches(entries: Iterable[tuple[int, int]], batch_size: int, budget: int) -> list[list[int]]:
    """``(index, size)`` in order, cut into runs of at most ``batch_size`` items whose sizes sum to at most
    ``budget`` (the codes of an encoder batch in the plan, the 24 kHz samples of a report-style audio batch).

    An item larger than ``budget`` alone is a batch of its own.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in entries:
        if cur and (len(cur) >= batch_size or total + n > budget):
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        out.append(cur)
    return out
