"""The ``--apertus-*`` arguments, added to Megatron-LM's parser as an ``extra_args_provider``.

:func:`add_apertus_args` has the signature Megatron expects (``parser -> parser``);
:func:`chain_extra_args` combines it with a script's own provider; :func:`options_from_args` turns
the parsed namespace into the core's configuration objects (:class:`ApertusOptions`). Nothing
here imports Megatron.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from apertus_plugins import plugins
from apertus_plugins.core.divergence import note
from apertus_plugins.core.goldfish import VARIANTS, GoldfishConfig
from apertus_plugins.core.packing import SFT_OVERSIZE, PackingConfig
from apertus_plugins.core.targets import SFT_SPECIALS, STAGE_TARGETS, Schedule, TargetConfig, stage_targets
from apertus_plugins.core.vocab import VocabSpec

from .ademamix import AdEMAMixSettings
from .errors import ApertusArgumentError

#: Goldfish's parameters, the report's (section 3.2: Apertus 1.0's, unchanged): the core's defaults.
GOLDFISH_K: int = GoldfishConfig().k
GOLDFISH_H: int = GoldfishConfig().h

__all__ = ["GROUP_TITLE", "add_apertus_args", "chain_extra_args", "ApertusOptions", "options_from_args",
           "parse_modality_weight", "describe_options"]

GROUP_TITLE = "apertus"

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_apertus_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the Apertus argument group to Megatron's parser; returns the parser (``extra_args_provider``)."""
    if any(getattr(g, "title", None) == GROUP_TITLE for g in parser._action_groups):
        return parser  # added already (the provider may be chained twice)
    g = parser.add_argument_group(GROUP_TITLE, "Apertus 1.5 (apertus-plugins): vocabulary, loss targets, "
                                  "SFT data, optimizer")
    g.add_argument("--apertus-recipe", default=None, metavar="NAME",
                   help="a training stage's flags (the report's: cpt-8b, cpt-70b, long-context-8b-32k ..., sft-8b, "
                   "sft-70b, long-context-sft-8b, long-context-sft-70b, goldfish) or a flag file, put before the "
                   "command line's by apertus-megatron; an explicit flag replaces the recipe's (`apertus-megatron "
                   "--recipes` lists them)")
    g.add_argument("--apertus-tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory whose id layout (VocabSpec) the loss targets use; default: "
                   "--tokenizer-model when it is a directory with tokenizer.json, else the released layout")
    # Megatron's own --padded-vocab-size under the plugin's name (the same destination): Megatron builds,
    # checkpoints and counts the embedding with it
    g.add_argument("--apertus-embedding-rows", type=int, default=None, metavar="N", dest="padded_vocab_size",
                   help="rows of the input embedding and output layer (the released model: 266752): Megatron's "
                   "--padded-vocab-size; default: Megatron's padded vocabulary size")
    # loss targets (SPEC.md 4.1)
    g.add_argument("--apertus-stage", default=None, choices=tuple(STAGE_TARGETS),
                   help="the report's continued-pretraining stage this run is (1, 2, 3 or long-context): sets the "
                   "stage's target preset (1: all; 2, 3, long-context: text-only) unless --apertus-targets names "
                   "one; a preset that contradicts the stage runs as asked and the divergence is logged once")
    g.add_argument("--apertus-targets", default=None, choices=("all", "text-only"),
                   help="target preset: all (stage 1, every modality predicted) or text-only (stage 2 on: only text "
                   "is predicted; omni markers, codes and task-control markers weigh 0); default: the stage's, "
                   "else all")
    g.add_argument("--apertus-modality-weight", action="append", default=[], metavar="NAME=W",
                   help="loss weight of a modality (text, omni, image, audio), overriding the preset; W is a number "
                   "or a schedule STEP:VALUE,STEP:VALUE,... (piecewise linear over iterations). Repeatable")
    g.add_argument("--apertus-exclude-ids", type=int, nargs="+", default=[], metavar="ID",
                   help="target ids that never count, on top of the preset's")
    g.add_argument("--apertus-exclude-tokens", nargs="+", default=[], metavar="NAME",
                   help="token names (e.g. stt_transcribe) excluded from the targets, on top of the preset's")
    g.add_argument("--apertus-no-eod-exclusion", action="store_true",
                   help="keep the label whose input is the end-of-document token (by default it is excluded)")
    g.add_argument("--apertus-goldfish-k", type=int, default=0, metavar="K",
                   help="Goldfish loss: drop about 1/K of the targets (0: off; Apertus: 50)")
    g.add_argument("--apertus-goldfish-h", type=int, default=50, metavar="H", help="Goldfish window (Apertus: 50)")
    g.add_argument("--apertus-goldfish-variant", default="hashtable", choices=VARIANTS,
                   help="hashtable (bit-compatible with the public implementation) or order-sensitive")
    g.add_argument("--apertus-goldfish-sft", action="store_true",
                   help="apply Goldfish to SFT samples as well (default: pretraining samples only)")
    # SFT data (SPEC.md 4.2)
    g.add_argument("--apertus-sft-data", nargs="+", default=[], metavar="PREFIX",
                   help="dataset prefixes (as given to --data-path and friends) that hold tokenized conversations: "
                   "their samples are packed best-fit-decreasing and get the SFT loss mask")
    g.add_argument("--apertus-sft-mask", default="derive", choices=("derive", "stored"),
                   help="derive the SFT mask from the ids on the fly (default) or read the stored mask stream")
    g.add_argument("--apertus-sft-specials", default="emitted", choices=SFT_SPECIALS,
                   help="special tokens of an assistant turn that are SFT targets: emitted (default: "
                   "<|assistant_end|> and the tool-call markers, the tokens the assistant writes) or none (every "
                   "special token masked, the literal reading of the report's Appendix G)")
    g.add_argument("--apertus-sft-mask-suffix", default=".mask", metavar="SUFFIX",
                   help="the stored mask of PREFIX is the indexed dataset PREFIX+SUFFIX (one uint8 per token)")
    g.add_argument("--apertus-sft-oversize", default="error", choices=SFT_OVERSIZE,
                   help="a conversation longer than --seq-length + 1: error (default) or split into pieces")
    g.add_argument("--apertus-bfd-data", nargs="+", default=[], metavar="PREFIX",
                   help="pretraining prefixes (as given to --data-path) whose documents are packed best-fit-decreasing "
                   "into samples with cross-document masking, as long-context stages pack (SPEC.md 4.1), instead of "
                   "being concatenated and cut; a document longer than a sample is split into pieces")
    g.add_argument("--apertus-packed-sequences", action="store_true",
                   help="deliver cu_seqlens for packed-sequence (THD) attention instead of an [S, S] attention "
                   "mask for cross-document masking (needs Transformer Engine, micro batch 1; required with "
                   "--context-parallel-size > 1, each sample split over the ranks as Transformer Engine expects)")
    g.add_argument("--apertus-pad-to-multiple", type=int, default=None, metavar="M",
                   help="with --apertus-packed-sequences: pad every packed document to a multiple of M tokens "
                   "(default 2 x --context-parallel-size when it is > 1, else 1; with context parallelism a "
                   "multiple of 2 x CP). The packing depends on M: runs that should see the same samples at "
                   "different CP sizes pass the same M")
    g.add_argument("--apertus-manifest", default=None, metavar="FILE",
                   help="the stage's dataset manifest: every prefix of the blend must be listed and unchanged")
    g.add_argument("--apertus-manifest-checksums", action="store_true",
                   help="also recompute the sha256 of every file at launch (default: sizes and counts only, which "
                   "scale to TB blends; `apertus manifest verify` does the full check offline)")
    # model and optimizer (SPEC.md 5, 6)
    g.add_argument("--apertus-optimizer", default="megatron", choices=("megatron", "ademamix"),
                   help="ademamix: AdEMAMix in place of Adam (needs --optimizer adam; --adam-beta1/2, --adam-eps, "
                   "--weight-decay apply)")
    g.add_argument("--apertus-ademamix-beta3", type=float, default=0.9999, help="AdEMAMix beta3 (slow EMA)")
    g.add_argument("--apertus-ademamix-alpha", type=float, default=8.0, help="AdEMAMix alpha")
    g.add_argument("--apertus-ademamix-alpha-warmup", type=int, default=100_000, metavar="STEPS",
                   help="AdEMAMix alpha warmup (0: none)")
    g.add_argument("--apertus-ademamix-beta3-warmup", type=int, default=100_000, metavar="STEPS",
                   help="AdEMAMix beta3 warmup (0: none)")
    g.add_argument("--apertus-weight-decay-on", default="all", choices=("all", "megatron"),
                   help="all: weight decay on every parameter, norm gains and xIELU scalars included (the Apertus "
                   "recipe); megatron: upstream's rule (no decay on biases and 1-D parameters)")
    g.add_argument("--apertus-allow-rope-change", action="store_true",
                   help="allow RoPE settings that differ from the loaded checkpoint's (context extension)")
    g.add_argument("--apertus-empty-steps", default="skip", choices=("skip", "error"),
                   help="a step whose global batch holds no loss target: skip its optimizer step, say so in the log "
                   "and count it (default), or stop the run")
    return parser


def chain_extra_args(*providers: Provider | None) -> Provider:
    """One ``extra_args_provider`` that applies each given one in order (``None`` entries skipped)."""
    chain = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            parser = p(parser)
        return parser

    return provider


def parse_modality_weight(text: str) -> tuple[str, float | Schedule]:
    """``"image=0"`` -> ``("image", 0.0)``; ``"image=0:1,1000:0"`` -> ``("image", Schedule(...))``."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ValueError(f"--apertus-modality-weight {text!r}: expected NAME=W or NAME=STEP:VALUE,...")
    try:
        if ":" in value:
            points = []
            for item in value.split(","):
                step, _, v = item.partition(":")
                points.append((float(step), float(v)))
            return name, Schedule(tuple(points))
        return name, float(value)
    except ValueError as exc:
        raise ValueError(f"--apertus-modality-weight {text!r}: {exc}") from exc


@dataclass(frozen=True)
class ApertusOptions:
    """The parsed ``--apertus-*`` arguments as the core's objects: the vocabulary, the targets, Goldfish
    (:class:`~apertus_plugins.core.goldfish.GoldfishConfig`), the packing
    (:class:`~apertus_plugins.core.packing.PackingConfig`) and AdEMAMix, each built once here and handed down."""

    spec: VocabSpec
    targets: TargetConfig
    goldfish: GoldfishConfig | None
    sft_mask: str
    sft_mask_suffix: str
    manifest: str | None
    manifest_checksums: bool
    embedding_rows: int | None
    optimizer: str
    packing: PackingConfig = field(default_factory=PackingConfig)
    ademamix: AdEMAMixSettings = field(default_factory=AdEMAMixSettings)
    weight_decay_on: str = "all"
    allow_rope_change: bool = False
    empty_steps: str = "skip"
    sft_specials: str = "emitted"

    # the packing settings by their flags' names, read-only (the settings themselves: :attr:`packing`)
    @property
    def sft_prefixes(self) -> tuple[str, ...]:
        return self.packing.sft_prefixes

    @property
    def bfd_prefixes(self) -> tuple[str, ...]:
        return self.packing.bfd_prefixes

    @property
    def sft_oversize(self) -> str:
        return self.packing.sft_oversize

    @property
    def packed_sequences(self) -> bool:
        return self.packing.packed_sequences

    @property
    def pad_multiple(self) -> int:
        return self.packing.pad_multiple


def _spec_from_args(args: argparse.Namespace) -> VocabSpec:
    path = getattr(args, "apertus_tokenizer", None)
    if path is None:
        model = getattr(args, "tokenizer_model", None)
        if model and (Path(model) / "tokenizer.json").is_file():
            path = model
    if path is None:
        return plugins.spec()
    if not (Path(path) / "tokenizer.json").is_file():
        raise ValueError(f"--apertus-tokenizer {path}: no tokenizer.json there")
    return plugins.spec_from_tokenizer_dir(path)


def options_from_args(args: argparse.Namespace) -> ApertusOptions:
    """Build :class:`ApertusOptions` from Megatron's parsed arguments (:class:`ApertusArgumentError` on bad input)."""
    try:
        return _options_from_args(args)
    except ApertusArgumentError:
        raise
    except (ValueError, KeyError) as exc:
        raise ApertusArgumentError(str(exc.args[0]) if isinstance(exc, KeyError) else str(exc)) from exc


def _options_from_args(args: argparse.Namespace) -> ApertusOptions:
    if getattr(args, "apertus_recipe", None):
        raise ValueError(f"--apertus-recipe {args.apertus_recipe}: recipes are expanded by the apertus-megatron launcher; "
                         "run the script through it (apertus-megatron SCRIPT ...)")
    spec = _spec_from_args(args)
    stage = getattr(args, "apertus_stage", None)
    preset_name = stage_targets(stage, args.apertus_targets)
    preset = TargetConfig.preset(preset_name, spec)
    weights = dict(preset.modality_weights)
    for item in args.apertus_modality_weight:
        name, w = parse_modality_weight(item)
        if name not in spec.modality_names:
            raise ValueError(f"--apertus-modality-weight {item!r}: unknown modality {name!r}; this vocabulary has "
                             f"{list(spec.modality_names)}")
        weights[name] = w
        if preset_name == "text-only" and name != "text" and w != 0.0:
            note(f"modality-weight:{name}", f"--apertus-modality-weight {item} trains {name} tokens on top of "
                 "text-only targets; the report predicts text only from stage 2 on, weight 0 on every non-text "
                 "token (section 3.2, Table 2)")
    if stage is not None and (args.apertus_goldfish_k, args.apertus_goldfish_h) != (GOLDFISH_K, GOLDFISH_H):
        note("goldfish", f"stage {stage} runs with --apertus-goldfish-k {args.apertus_goldfish_k} --apertus-goldfish-h "
             f"{args.apertus_goldfish_h}; the report keeps "
             f"Apertus 1.0's Goldfish loss (k = {GOLDFISH_K}, h = {GOLDFISH_H}) in every continued-pretraining stage "
             "(section 3.2)")
    for name in args.apertus_exclude_tokens:
        try:
            spec.id(name)
        except KeyError as exc:
            raise ValueError(f"--apertus-exclude-tokens: {exc.args[0]}") from exc
    for i in args.apertus_exclude_ids:
        if not 0 <= i < spec.size:
            raise ValueError(f"--apertus-exclude-ids: id {i} outside the vocabulary 0..{spec.size - 1}")
    targets = TargetConfig(
        modality_weights=weights,
        excluded_ids=tuple(preset.excluded_ids) + tuple(args.apertus_exclude_ids),
        excluded_names=tuple(preset.excluded_names) + tuple(args.apertus_exclude_tokens),
        end_of_document=None if args.apertus_no_eod_exclusion else preset.end_of_document,
    )
    goldfish = None
    if args.apertus_goldfish_k > 0:
        if args.apertus_goldfish_h < 1:
            raise ValueError(f"--apertus-goldfish-h must be >= 1, got {args.apertus_goldfish_h}")
        goldfish = GoldfishConfig(k=args.apertus_goldfish_k, h=args.apertus_goldfish_h,
                                  variant=args.apertus_goldfish_variant, on_sft=bool(args.apertus_goldfish_sft))
    both = sorted(set(map(os.path.normpath, args.apertus_sft_data)) & set(
        map(os.path.normpath, getattr(args, "apertus_bfd_data", []))))
    if both:
        raise ValueError(f"--apertus-bfd-data and --apertus-sft-data both name {', '.join(both)}: a prefix holds either "
                         "pretraining documents or conversations")
    if args.apertus_sft_mask == "stored" and getattr(args, "apertus_sft_specials", "emitted") != "emitted":
        raise ValueError("--apertus-sft-specials none derives the SFT mask from the ids; with --apertus-sft-mask "
                         "stored the stored stream decides (written with the default, emitted): drop one of them")
    rows = getattr(args, "padded_vocab_size", None)
    if rows is not None:
        spec.check_embedding(rows, "embedding (--apertus-embedding-rows / --padded-vocab-size)")
    packing = PackingConfig(
        sft_prefixes=tuple(args.apertus_sft_data),
        bfd_prefixes=tuple(getattr(args, "apertus_bfd_data", [])),
        sft_oversize=args.apertus_sft_oversize,
        packed_sequences=bool(args.apertus_packed_sequences),
        pad_multiple=_pad_multiple(args),
    )
    return ApertusOptions(
        spec=spec,
        targets=targets,
        goldfish=goldfish,
        packing=packing,
        sft_mask=args.apertus_sft_mask,
        sft_mask_suffix=args.apertus_sft_mask_suffix,
        sft_specials=getattr(args, "apertus_sft_specials", "emitted"),
        manifest=args.apertus_manifest,
        manifest_checksums=bool(getattr(args, "apertus_manifest_checksums", False)),
        embedding_rows=rows,
        optimizer=args.apertus_optimizer,
        ademamix=AdEMAMixSettings(beta3=args.apertus_ademamix_beta3, alpha=args.apertus_ademamix_alpha,
                                  alpha_warmup=args.apertus_ademamix_alpha_warmup or None,
                                  beta3_warmup=args.apertus_ademamix_beta3_warmup or None),
        weight_decay_on=args.apertus_weight_decay_on,
        allow_rope_change=bool(args.apertus_allow_rope_change),
        empty_steps=getattr(args, "apertus_empty_steps", "skip"),
    )


def _pad_multiple(args: argparse.Namespace) -> int:
    """The padding multiple of packed documents: ``--apertus-pad-to-multiple`` or ``2 x CP`` (1 without CP)."""
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    packed = bool(args.apertus_packed_sequences)
    given = getattr(args, "apertus_pad_to_multiple", None)
    if given is None:
        return 2 * cp if packed and cp > 1 else 1
    if not packed:
        raise ValueError(f"--apertus-pad-to-multiple {given}: only packed sequences are padded; pass "
                         "--apertus-packed-sequences")
    if given < 1:
        raise ValueError(f"--apertus-pad-to-multiple must be >= 1, got {given}")
    if cp > 1 and given % (2 * cp):
        raise ValueError(f"--apertus-pad-to-multiple {given}: with --context-parallel-size {cp} every packed document "
                         f"is split into 2 x {cp} chunks, so the multiple must be a multiple of {2 * cp}")
    return int(given)


def describe_options(options: ApertusOptions) -> str:
    """One line saying what the plugin does in this run (printed by the launcher at start)."""
    weights = {k: (str(v) if not isinstance(v, (int, float)) else f"{v:g}")
               for k, v in options.targets.modality_weights.items()}
    parts = [f"vocabulary {options.spec.size} ids", f"modality weights {weights or 'all 1'}",
             "end-of-document rule " + ("on" if options.targets.end_of_document else "off"),
             "Goldfish " + (options.goldfish.describe() if options.goldfish else "off"),
             "optimizer " + ("AdEMAMix " + options.ademamix.describe() if options.optimizer == "ademamix" else "Megatron's"),
             f"weight decay on {options.weight_decay_on}", f"steps without targets: {options.empty_steps}"]
    if options.packing.sft_prefixes:
        parts.append(f"SFT prefixes {list(options.packing.sft_prefixes)} (mask {options.sft_mask})")
    parts += options.packing.describe()
    return "apertus: " + "; ".join(parts)
