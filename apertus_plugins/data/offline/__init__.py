"""Offline tokenization: images, audio and conversations into Megatron indexed datasets.

``apertus tokenize pretrain|sft|interleaved ...`` on the command line; from Python::

    from apertus_plugins.data.offline import TokenizeConfig, tokenize
    report = tokenize(TokenizeConfig("pretrain", ["images/"], out="data/images",
                                     tokenizer="tok/", checkpoint="ckpt/"))

The stages (see each module): :mod:`.sources` (inputs, planning shards, header-only shapes),
:mod:`.plan` (the deterministic, shape-uniform batches as per-shard files, and the typed
``plan.json``), :mod:`.planner` (the driver's planning steps), :mod:`.steps` (each step a small
class over typed records: scan, batch, read -> preprocess -> encode -> pack -> write, merge),
:mod:`.worker` (the steps as tasks), :mod:`.execute` (in process, local processes, or Ray tasks and
encoder actors), :mod:`.run` (the driver: resume, merge, manifest, report), :mod:`.progress`
(items/s, encoder utilisation, skips, ETA), :mod:`.storage` (local paths and fsspec URLs),
:mod:`.preprocess` (the run's media settings: the one seam to the core's media functions),
:mod:`.faults` (fault points for tests and drills), :mod:`.lifeline` (helpers that die with the
driver), :mod:`.rayhead` (a loopback-only Ray head of the run's own), :mod:`.batching` (how audio
clips share an encoder batch: exact lengths, or the report's padded duration buckets) and
:mod:`.interleaved` (recordings into the report's interleaved speech-text documents).
"""

from .config import IMAGE_LAYOUT_DEFAULT, TokenizeConfig
from .run import REPORT_FORMAT, RunError, format_report, tokenize

__all__ = ["IMAGE_LAYOUT_DEFAULT", "TokenizeConfig", "REPORT_FORMAT", "RunError", "format_report", "tokenize"]
