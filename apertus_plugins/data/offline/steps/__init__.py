"""The offline pipeline as steps, each a small class over typed records (:mod:`.records`).

Planning (a task per shard, then per part): :class:`~.plan.ScanShard` (a shard's items from
headers) and :class:`~.plan.BatchPart` (a part's batches). A batch (:class:`~.batch.RunBatch`):
:class:`~.read.ReadBatch` (its line of the plan) -> :class:`~.preprocess.Preprocess` (media
decoded and resized, conversations parsed) -> :class:`~.encode.Encode` (codes, bisecting around
an array the encoder fails on) -> :class:`~.pack.Pack` (documents per stream) ->
:class:`~.write.Write` (shards, then the record that commits the batch). Merging:
:class:`~.merge.MergePart` over :func:`~.merge.concatenate`, the one merge path.

Every step takes the process's :class:`~.context.RunContext` (the settings, and the tokenizer and
encoders loaded on first use) and is called on one unit of work; whatever one item raises costs
only that item.
"""

from .batch import RunBatch
from .context import RunContext
from .encode import Encode
from .merge import MergePart, aggregate, concatenate, megatron_builder
from .pack import Pack
from .plan import BatchPart, ScanShard
from .preprocess import Preprocess
from .read import ReadBatch
from .records import Decoded, Encoded, Packed
from .write import Write

__all__ = ["RunContext", "ScanShard", "BatchPart", "ReadBatch", "Preprocess", "Encode", "Pack", "Write", "RunBatch",
           "MergePart", "concatenate", "aggregate", "megatron_builder", "Decoded", "Encoded", "Packed"]
