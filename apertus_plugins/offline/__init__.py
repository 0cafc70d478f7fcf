"""Offline tokenization: images, audio and conversations into Megatron indexed datasets.

``apertus tokenize pretrain|sft ...`` on the command line; from Python::

    from apertus_plugins.offline import TokenizeConfig, tokenize
    report = tokenize(TokenizeConfig("pretrain", ["images/"], out="data/images",
                                     tokenizer="tok/", checkpoint="ckpt/"))

The stages (see each module): :mod:`.sources` (inputs and header-only shapes), :mod:`.plan`
(the deterministic, shape-uniform batches), :mod:`.worker` (a batch: decode, encode, write its
shards, checkpoint), :mod:`.run` (local processes or Ray, resume, merge, manifest, report).
"""

from .config import IMAGE_LAYOUT_DEFAULT, TokenizeConfig
from .run import REPORT_FORMAT, RunError, format_report, tokenize

__all__ = ["IMAGE_LAYOUT_DEFAULT", "TokenizeConfig", "REPORT_FORMAT", "RunError", "format_report", "tokenize"]
