"""The settings of one offline tokenization run, and what of them decides the output bytes.

A :class:`TokenizeConfig` holds everything ``apertus tokenize`` takes. Its :meth:`fingerprint`
covers exactly the settings that change what is written or how it is planned (inputs, tokenizer,
encoder checkpoint, layouts, policies, batching, planning shards, the merge); the settings that
only change how the work is scheduled (worker count, a Ray address, encoder actors, the device,
progress bars) are left out, so a run resumed with a different worker count or on a Ray cluster
continues the same plan and writes the same bytes.

``sources``, ``out`` and ``work_dir`` may be URLs of any fsspec filesystem (:mod:`.storage`);
the tokenizer and the checkpoint are local folders (on every node of a Ray cluster).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from apertus_plugins.core.media.limits import DEFAULT_LIMITS, MediaLimits

from .batching import AUDIO_BATCHINGS, AudioBatching
from .preprocess import MediaSettings
from .storage import canonical, normalize

__all__ = ["KINDS", "IMAGE_LAYOUT_DEFAULT", "AUDIO_TASKS", "CAPTIONS", "MERGES", "DEVICES", "MAX_BAD_FRACTION_DEFAULT",
           "Stream", "TokenizeConfig", "default_workers"]

#: What a run produces: ``pretrain`` (one media item per document), ``sft`` (one conversation) or
#: ``interleaved`` (the interleaved speech-text sequences of recordings, report 2.2.4).
KINDS = ("pretrain", "sft", "interleaved")

#: The image layout datasets are written in unless ``--image-layout`` says otherwise: the layout
#: of the public Megatron tokenization pipeline, i.e. of the data Apertus 1.5 was trained on
#: (SPEC.md 2.1). Serving uses the ``inference`` layout; the manifest records the layout so the
#: skew is visible and checkable.
IMAGE_LAYOUT_DEFAULT = "training"

#: Pretraining audio documents: ``auto`` transcribes when a transcript is present, else audio only.
AUDIO_TASKS = ("auto", "audio", "transcribe", "translate", "annotate")

#: Where a caption goes in a pretraining image document.
CAPTIONS = ("after", "before", "ignore")

#: What the merge writes: ``single`` (one dataset per stream, ``OUT.bin``/``.idx``, as before) or
#: ``parts`` (one dataset per plan part, ``OUT.partNNNNNN.bin``/``.idx``, merged in parallel and
#: listed in order in the manifest; no pass over all the data on one node).
MERGES = ("single", "parts")

#: Encoder devices: ``auto`` (CUDA when the machine or the Ray cluster has a GPU, else CPU).
DEVICES = ("auto", "cpu", "cuda")

#: The share of a run's input items that may be skipped before the run stops (``--max-bad-fraction``).
MAX_BAD_FRACTION_DEFAULT = 0.5

#: Files of a folder per planning shard, and bytes of a JSONL file per planning shard.
PLAN_FILES_DEFAULT = 4096
PLAN_BYTES_DEFAULT = 256 * 2**20


def default_workers() -> int:
    """Local worker processes by default: the CPU count, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class Stream:
    """One output dataset of a run: ``PREFIX + suffix`` with its token dtype."""

    suffix: str
    dtype: str  # numpy dtype name
    what: str


@dataclass
class TokenizeConfig:
    """Everything a run needs. See ``apertus tokenize --help`` for the user-facing description.

    Attributes:
        kind: ``"pretrain"`` or ``"sft"``.
        sources: image/audio files and folders, WebDataset ``.tar`` shards (pretrain); JSONL files (sft).
        out: the output prefix (``OUT.bin``/``OUT.idx`` and the side files).
        tokenizer: a tokenizer directory (text ids, the image size header, the id layout).
        checkpoint: the media encoders' checkpoint directory; needed when any item has media.
        work_dir: shards, plan and checkpoints (default ``OUT.work``).
        image_layout: ``training`` (default) or ``inference`` (SPEC.md 2.1).
        resize_policy / audio_policy: the core's named preprocessing policies.
        media_limits: overrides of the core's media limits
            (:class:`~apertus_plugins.core.media.limits.MediaLimits` field -> value; the defaults bound
            one item's cost; an item above a limit is skipped with its reason).
        audio_task: pretraining audio documents (see :data:`AUDIO_TASKS`).
        captions: where a caption of a pretraining image goes (see :data:`CAPTIONS`).
        bos / eos: pretraining documents start with BOS / end with EOS (the end-of-document token).
        without_reasoning: sft: also write ``OUT.noreason`` with the reasoning spans removed.
        mask_stream: sft: also write the token-aligned loss mask as ``OUT.mask`` (uint8).
        media_root: sft: relative media paths are resolved against it (default: the JSONL's folder).
        batch_size / batch_codes: the most items and media codes per batch.
        audio_batching: ``exact`` (default: clips batched by identical length, no padding, every code
            kept) or ``report`` (duration buckets, padding, the last five codes of a padded clip
            dropped); see :mod:`.batching`. audio_batch_seconds / audio_buckets: the ``report``
            batching's cap on a batch's total audio duration and its number of duration buckets.
        split_tokens: interleaved: sequences longer than this many tokens go to ``OUT.long`` instead
            of ``OUT`` (the report's 8,192-token cut between stage 2 and long context); 0: no cut.
        window: consecutive source items grouped by shape together (pretrain).
        precision: the encoders' precision contract (``float32`` or ``tf32``).
        plan_files / plan_bytes: the planning shards: files of a folder, bytes of a JSONL file.
        merge: ``single`` or ``parts`` (see :data:`MERGES`).
        workers / ray_address / encoders / device / progress / keep_work / restart / plan_only: how
            the run is executed (``encoders``: encoder actors on Ray, 0 for one per GPU or per two
            CPUs; ``plan_only``: stop after the plan, keeping the work directory).
        max_bad_fraction: the run stops, with its report, once more than this share of its input
            items is certain (or, from the first 1,000 items encoded, projected) to be skipped;
            1 never stops. Not part of the fingerprint: a stopped run resumes with a higher value.
        media_cache / media_cache_size: the persistent media-code cache
            (:mod:`apertus_plugins.encoders.cache`; default ``$APERTUS_MEDIA_CACHE`` /
            ``$APERTUS_MEDIA_CACHE_SIZE`` of the driver, else off): stored codes are read, only the
            other items are encoded. Not part of the fingerprint: the codes are the same either way.
    """

    kind: str
    sources: list[str]
    out: str
    tokenizer: str
    checkpoint: str | None = None
    work_dir: str | None = None
    image_layout: str = IMAGE_LAYOUT_DEFAULT
    resize_policy: str = "released"
    audio_policy: str = "released"
    media_limits: dict[str, float] = field(default_factory=dict)
    audio_task: str = "auto"
    captions: str = "after"
    bos: bool = True
    eos: bool = True
    without_reasoning: bool = False
    mask_stream: bool = False
    media_root: str | None = None
    batch_size: int = 32
    batch_codes: int = 65536
    audio_batching: str = "exact"
    audio_batch_seconds: float = 1500.0
    audio_buckets: int = 20
    split_tokens: int = 0
    window: int = 4096
    precision: str = "float32"
    plan_files: int = PLAN_FILES_DEFAULT
    plan_bytes: int = PLAN_BYTES_DEFAULT
    merge: str = "single"
    # execution only: never part of the fingerprint
    workers: int = field(default_factory=default_workers)
    ray_address: str | None = None
    encoders: int = 0
    device: str = "auto"
    progress: bool = True
    keep_work: bool = False
    restart: bool = False
    plan_only: bool = False
    max_bad_fraction: float = MAX_BAD_FRACTION_DEFAULT
    media_cache: str | None = None
    media_cache_size: str | None = None

    _EXECUTION = ("workers", "ray_address", "encoders", "device", "progress", "keep_work", "restart", "work_dir",
                  "plan_only", "max_bad_fraction", "media_cache", "media_cache_size")

    def __post_init__(self) -> None:
        from apertus_plugins.core.media.audio import AUDIO_POLICIES
        from apertus_plugins.core.media.image import LAYOUTS, POLICIES

        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        if not self.sources:
            raise ValueError("no input sources given")
        from apertus_plugins.encoders.cache import MEDIA_CACHE_ENV, MEDIA_CACHE_SIZE_ENV
        from apertus_plugins.infra.sizes import parse_size

        # the driver's environment travels to the workers (Ray hosts included) through the config
        if self.media_cache is None:
            self.media_cache = os.environ.get(MEDIA_CACHE_ENV) or None
        if self.media_cache_size is None:
            self.media_cache_size = os.environ.get(MEDIA_CACHE_SIZE_ENV) or None
        if self.media_cache_size is not None and not parse_size(self.media_cache_size):
            raise ValueError(f"media cache size {self.media_cache_size!r}: must be positive")
        if self.image_layout not in LAYOUTS:
            raise ValueError(f"unknown image layout {self.image_layout!r}; layouts are {', '.join(LAYOUTS)}")
        if self.resize_policy not in POLICIES:
            raise ValueError(f"unknown resize policy {self.resize_policy!r}; policies are {', '.join(POLICIES)}")
        if self.audio_policy not in AUDIO_POLICIES:
            raise ValueError(f"unknown audio policy {self.audio_policy!r}; policies are {', '.join(AUDIO_POLICIES)}")
        unknown = sorted(set(self.media_limits) - set(MediaLimits.names()))
        if unknown:
            raise ValueError(f"unknown media limit(s) {', '.join(unknown)}; limits are {', '.join(MediaLimits.names())}")
        DEFAULT_LIMITS.updated(self.media_limits)  # the values are checked here, before any work
        if self.audio_task not in AUDIO_TASKS:
            raise ValueError(f"unknown audio task {self.audio_task!r}; tasks are {', '.join(AUDIO_TASKS)}")
        if self.captions not in CAPTIONS:
            raise ValueError(f"unknown caption placement {self.captions!r}; choose {', '.join(CAPTIONS)}")
        if self.audio_batching not in AUDIO_BATCHINGS:
            raise ValueError(f"unknown audio batching {self.audio_batching!r}; choose {', '.join(AUDIO_BATCHINGS)}")
        self.audio_batching_settings()  # the values are checked here
        if int(self.split_tokens) < 0:
            raise ValueError(f"split_tokens must be 0 (no cut) or more, got {self.split_tokens}")
        if self.split_tokens and self.kind != "interleaved":
            raise ValueError("--split-tokens applies to interleaved runs only")
        for name in ("batch_size", "batch_codes", "window", "plan_files", "plan_bytes"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"workers must be 0 (in this process) or more, got {self.workers}")
        if self.encoders < 0:
            raise ValueError(f"encoders must be 0 (one per GPU, or per two CPUs) or more, got {self.encoders}")
        if self.merge not in MERGES:
            raise ValueError(f"unknown merge {self.merge!r}; choose {', '.join(MERGES)}")
        if self.merge == "parts" and any(c.isspace() for c in self.out):
            raise ValueError(f"--out {self.out!r}: --merge parts lists the part prefixes in a file for Megatron's "
                             "--data-args-path, which splits on whitespace: use a prefix without spaces")
        if not 0.0 <= float(self.max_bad_fraction) <= 1.0:
            raise ValueError(f"max_bad_fraction must be between 0 and 1, got {self.max_bad_fraction}")
        if self.device.split(":", 1)[0] not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; devices are auto, cpu, cuda and cuda:N")
        if self.precision == "tf32" and self.device == "cpu":
            raise ValueError("--precision tf32 needs a CUDA device; use float32 on CPU")
        if self.kind != "sft" and (self.without_reasoning or self.mask_stream):
            raise ValueError("--without-reasoning and --mask-stream apply to sft runs only")
        if not Path(self.tokenizer, "tokenizer.json").is_file():
            raise ValueError(f"{self.tokenizer}: not a tokenizer directory (no tokenizer.json)")
        if self.checkpoint is not None and not Path(self.checkpoint).is_dir():
            raise ValueError(f"{self.checkpoint}: no such checkpoint directory")

    # ------------------------------------------------------------------ paths
    @property
    def work(self) -> str:
        """The work directory (a path or a URL): plan, shards, batch records, lock."""
        return self.work_dir if self.work_dir else f"{self.out}.work"

    def streams(self) -> list[Stream]:
        """The datasets this run writes, the main one first."""
        out = [Stream("", "int32", "tokens")]
        if self.kind == "interleaved" and self.split_tokens:
            out.append(Stream(".long", "int32", f"sequences longer than {self.split_tokens} tokens"))
        if self.kind == "sft":
            if self.mask_stream:
                out.append(Stream(".mask", "uint8", "loss mask of the tokens"))
            if self.without_reasoning:
                out.append(Stream(".noreason", "int32", "tokens, reasoning spans removed"))
                if self.mask_stream:
                    out.append(Stream(".noreason.mask", "uint8", "loss mask, reasoning spans removed"))
        return out

    def prefix(self, stream: Stream) -> str:
        """The stream's dataset prefix, normalized as Megatron's preflight compares prefixes."""
        return normalize(f"{self.out}{stream.suffix}")

    def part_prefix(self, part: int, stream: Stream) -> str:
        """With ``merge="parts"``: the stream's dataset of one plan part."""
        return normalize(f"{self.out}.part{part:06d}{stream.suffix}")

    def manifests(self) -> dict[str, list[Stream]]:
        """Manifest file -> the streams it lists: each token dataset with its mask stream (used together)."""
        out: dict[str, list[Stream]] = {}
        for s in self.streams():
            base = s.suffix.removesuffix(".mask")
            out.setdefault(normalize(f"{self.out}{base}") + ".manifest.json", []).append(s)
        return out

    @property
    def report_path(self) -> str:
        return f"{self.out}.report.json"

    def data_args_path(self, manifest: str) -> str:
        """``merge="parts"``: the file for Megatron-LM's ``--data-args-path`` beside a manifest
        (``OUT.data-args.txt`` beside ``OUT.manifest.json``)."""
        return manifest.removesuffix(".manifest.json") + ".data-args.txt"

    def audio_batching_settings(self) -> AudioBatching | None:
        """The ``report`` audio batching's settings, ``None`` for the default ``exact`` batching."""
        if self.audio_batching == "exact":
            return None
        return AudioBatching(float(self.audio_batch_seconds), int(self.audio_buckets))

    def media_settings(self) -> MediaSettings:
        """How this run's media are read: the one place its settings become the core's (see :mod:`.preprocess`)."""
        return MediaSettings(resize_policy=self.resize_policy, audio_policy=self.audio_policy,
                             limits=DEFAULT_LIMITS.updated(self.media_limits))

    # ------------------------------------------------------------------ identity
    def settings(self) -> dict[str, Any]:
        """The output-deciding settings (JSON-ready)."""
        data = {k: v for k, v in asdict(self).items() if k not in self._EXECUTION}
        data["sources"] = [canonical(s) for s in self.sources]
        data["tokenizer"] = os.path.abspath(self.tokenizer)
        data["checkpoint"] = os.path.abspath(self.checkpoint) if self.checkpoint else None
        data["media_root"] = canonical(self.media_root) if self.media_root else None
        return data

    def fingerprint(self) -> dict[str, Any]:
        """Settings plus digests of the tokenizer files and the checkpoint's file listing."""
        return {
            "settings": self.settings(),
            "tokenizer_sha256": _digest_files(Path(self.tokenizer), ("tokenizer.json", "tokenizer_config.json")),
            "checkpoint_files": _listing(Path(self.checkpoint)) if self.checkpoint else None,
        }


def _digest_files(folder: Path, names: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for n in names:
        f = folder / n
        h.update(n.encode())
        h.update(f.read_bytes() if f.is_file() else b"<absent>")
    return h.hexdigest()


def _listing(folder: Path) -> list[list[Any]]:
    """Name, size and modification time of every file of a checkpoint (hashing weights would be slow)."""
    out = []
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            st = f.stat()
            out.append([str(f.relative_to(folder)), st.st_size, st.st_mtime_ns])
    return out


def canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
