"""Loss targets from token ids (SPEC.md section 4): the SFT mask and the pretraining weights.

Conventions shared by every function here: the input ``ids`` has length ``L``; the labels are
``ids[1:]``; every per-label output has length ``L-1`` and is indexed by the label position ``j``
(label ``j`` is ``ids[j+1]``, predicted from the input ``ids[j]``). 2-D inputs ``(B, L)`` are rows
of independent sequences and give ``(B, L-1)`` outputs. numpy arrays, sequences and torch tensors are
accepted; for a torch tensor the result is a torch tensor on the same device (torch is imported
only then).

Everything is vectorized: no Python loop runs over tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ._arrays import like as _like
from ._arrays import to_numpy as _to_numpy
from .goldfish import GoldfishConfig
from .vocab import VocabSpec, default_spec

__all__ = [
    "StartState",
    "SftSpecials",
    "SFT_SPECIALS",
    "sft_mask",
    "sft_mask_from_stored",
    "Schedule",
    "TargetConfig",
    "TargetWeights",
    "pretraining_targets",
    "sft_targets",
    "STAGE_TARGETS",
    "stage_targets",
]

StartState = Literal["auto", "none", "assistant", "tool_output"]
#: Which special tokens inside an assistant turn are SFT targets (report Appendix G: "restrict the loss to
#: assistant regions with special tokens masked"): ``"emitted"`` (the default, the release's reading): the
#: ones the assistant writes itself, ``<|assistant_end|>`` and the tool-call markers ``<|tools_prefix|>`` /
#: ``<|tools_suffix|>`` (the released stops; a model that never learns them cannot end a turn or call a
#: tool), every other special token masked; ``"none"``: the literal reading, every special token masked.
SftSpecials = Literal["emitted", "none"]
SFT_SPECIALS: tuple[str, ...] = ("emitted", "none")

#: Markers that change the turn state (closing or opening a turn, or a conversation boundary).
_TURN_OPENERS_OTHER = ("system_start", "developer_start", "user_start")
_TURN_CLOSERS = ("system_end", "developer_end", "user_end")
_RESETS = ("bos", "eos")

# token classes of the SFT state machine (_NEVER: a plain token that is never a target)
_PLAIN, _A_START, _A_END, _T_START, _T_END, _OTHER_TURN, _NEVER = 0, 1, 2, 3, 4, 5, 6


class _SftTables:
    """Per-spec lookup tables over ids: the state-machine class and the never-trained flag."""

    def __init__(self, spec: VocabSpec) -> None:
        size = spec.size
        cls = np.zeros(size, dtype=np.int8)
        cls[spec.id("assistant_start")] = _A_START
        cls[spec.id("assistant_end")] = _A_END
        cls[spec.id("tool_output_start")] = _T_START
        cls[spec.id("tool_output_end")] = _T_END
        for name in _TURN_OPENERS_OTHER + _TURN_CLOSERS + _RESETS:
            cls[spec.id(name)] = _OTHER_TURN
        cls[spec.pad_id] = _NEVER
        cls[spec.text_size :] = _NEVER  # omni markers and media codes: the LM head predicts text only
        self.cls = cls
        self.size = size
        self.special = spec.special_mask(size)


_TABLE_CACHE: dict[int, tuple[VocabSpec, _SftTables]] = {}


def _sft_tables(spec: VocabSpec) -> _SftTables:
    hit = _TABLE_CACHE.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = (spec, _SftTables(spec))
        _TABLE_CACHE[id(spec)] = hit
    return hit[1]


def _check_ids(arr: np.ndarray, size: int) -> np.ndarray:
    ids = arr.astype(np.int64, copy=False)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= size):
        raise ValueError(f"token ids must lie in 0..{size - 1} for this vocabulary, found {ids.min()}..{ids.max()}")
    return ids


def _sft_mask_1d(ids: np.ndarray, tables: _SftTables, start_inside: str, specials: str = "emitted") -> np.ndarray:
    n = ids.size
    if n < 2:
        return np.zeros(max(n - 1, 0), dtype=bool)
    cls = tables.cls[ids]
    # every marker class (1..5) is a tool-output event; the turn markers among them also set the turn
    marker_pos = np.flatnonzero((cls.view(np.uint8) - np.uint8(1)) < np.uint8(5))
    marker_cls = cls[marker_pos]
    if start_inside == "auto":
        first = int(marker_cls[0]) if marker_pos.size else _PLAIN
        start_inside = {_A_END: "assistant", _T_START: "assistant", _T_END: "tool_output"}.get(first, "none")
    init_a = start_inside in ("assistant", "tool_output")
    init_t = start_inside == "tool_output"
    # the state after each marker: the assistant flag comes from the last turn marker so far
    # (forward-filled over the markers), the tool-output flag from the marker itself
    is_turn = (marker_cls != _T_START) & (marker_cls != _T_END)
    k = np.arange(marker_pos.size, dtype=np.int64)
    last_turn = np.maximum.accumulate(np.where(is_turn, k, -1)) if k.size else k
    after_a = np.where(last_turn >= 0, marker_cls[np.maximum(last_turn, 0)] == _A_START, init_a)
    after_t = marker_cls == _T_START
    state = np.empty(marker_pos.size + 1, dtype=bool)
    state[0] = init_a and not init_t
    state[1:] = after_a & ~after_t
    # position p takes the state after the last marker strictly before it: positions 0..m_0 the
    # start state, m_i+1..m_{i+1} the state after marker i, m_last+1..n-1 the state after the last
    bounds = np.empty(marker_pos.size + 2, dtype=np.int64)
    bounds[0] = -1
    bounds[1:-1] = marker_pos
    bounds[-1] = n - 1
    trained = np.repeat(state, np.diff(bounds))
    trained &= (cls == _PLAIN) | (cls == _A_END)  # every other marker, and _NEVER, is never a target
    if specials == "none":
        trained &= ~tables.special[ids]
    return trained[1:]


def sft_mask(ids: Any, spec: VocabSpec | None = None, *, start_inside: StartState = "auto",
             specials: SftSpecials = "emitted") -> Any:
    """The SFT loss mask of a token sequence, computed on its labels (SPEC.md 4.2).

    Args:
        ids: token ids of length ``L`` (1-D) or ``(B, L)``.
        spec: the vocabulary layout (default: the released layout, ``vocab.default_spec()``).
        start_inside: the state before ``ids[0]`` when the sequence was cut out of a longer one:
            ``"none"`` (outside any turn), ``"assistant"`` (inside an assistant turn),
            ``"tool_output"`` (inside a tool output of an assistant turn), or ``"auto"``: inferred
            from the first state marker of the sequence (``<|assistant_end|>`` or
            ``<|tool_output_start|>`` first -> assistant; ``<|tool_output_end|>`` first -> tool
            output; any other turn marker, BOS/EOS, or no marker at all -> none).
        specials: which special tokens of an assistant turn are targets (:data:`SftSpecials`):
            ``"emitted"`` (default) trains ``<|assistant_end|>`` and the tool-call markers, the tokens the
            assistant writes and the released stops; ``"none"`` masks every special token (the literal
            reading of the report's "special tokens masked", Appendix G).

    Returns:
        bool array of length ``L-1`` (``(B, L-1)``); entry ``j`` says whether label ``j`` (``ids[j+1]``)
        is trained.

    The rule, as a state machine over the token positions ``p`` (a label is trained iff its token is):

    * the turn state at ``p`` is set by the last turn marker strictly before ``p``:
      ``<|assistant_start|>`` -> inside an assistant turn; ``<|assistant_end|>``, the system,
      developer and user start and end markers, BOS and EOS -> not (BOS/EOS also separate the
      conversations packed into one sequence);
    * the tool-output state at ``p`` is set by the last tool-output marker or turn marker strictly
      before ``p``: inside iff that is ``<|tool_output_start|>`` (a turn marker closes an unclosed
      tool output);
    * token ``p`` is trained iff it is inside an assistant turn, not inside a tool output, and it is
      not a never-trained id: every turn and tool-output marker except ``<|assistant_end|>`` (so
      ``<|assistant_start|>`` and both tool-output markers are excluded, ``<|assistant_end|>`` is
      trained when it closes an assistant turn outside a tool output), BOS, EOS, ``<pad>``, and every
      id at or above the text boundary (omni markers and media codes: the LM head predicts text).

    Thinking delimiters and tool-call markers are plain tokens: trained inside assistant turns (with
    ``specials="none"`` the tool-call markers and ``<|assistant_end|>``, special tokens, are masked too;
    the thinking delimiters are no special tokens and stay trained).
    """
    spec = spec or default_spec()
    if start_inside not in ("auto", "none", "assistant", "tool_output"):
        raise ValueError(f"start_inside must be auto, none, assistant or tool_output, got {start_inside!r}")
    if specials not in SFT_SPECIALS:
        raise ValueError(f"specials must be one of {', '.join(SFT_SPECIALS)}, got {specials!r}")
    arr, src = _to_numpy(ids)
    tables = _sft_tables(spec)
    if arr.ndim == 1:
        out = _sft_mask_1d(_check_ids(arr, tables.size), tables, start_inside, specials)
    elif arr.ndim == 2:
        checked = _check_ids(arr, tables.size)
        out = np.zeros((arr.shape[0], max(arr.shape[1] - 1, 0)), dtype=bool)
        for b in range(arr.shape[0]):
            out[b] = _sft_mask_1d(checked[b], tables, start_inside, specials)
    else:
        raise ValueError(f"ids must be 1-D or 2-D, got shape {arr.shape}")
    return _like(out, src)


def sft_mask_from_stored(stored: Any, length: int | None = None) -> Any:
    """The SFT mask read from a stored mask stream instead of derived (SPEC.md 4.2).

    ``stored`` is aligned with the tokens (length ``L``: entry ``p`` says whether token ``p`` is a
    trained target) or with the labels (length ``L-1``). Pass ``length=L``, the token count, to say
    which; without it a token-aligned stream is assumed. Returns the bool mask of length ``L-1``.
    """
    arr, src = _to_numpy(stored)
    mask = arr.astype(bool)
    n = mask.shape[-1]
    if length is None or n == length:
        out = mask[..., 1:]
    elif n == length - 1:
        out = mask
    else:
        raise ValueError(f"the stored mask has {n} entries; expected {length} (per token) or {length - 1} (per label)")
    return _like(np.ascontiguousarray(out), src)


@dataclass(frozen=True)
class Schedule:
    """A piecewise-linear value over training steps: ``points`` are ``(step, value)`` pairs.

    Constant before the first point and after the last.
    """

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        pts = tuple((float(s), float(v)) for s, v in self.points)
        if not pts:
            raise ValueError("a schedule needs at least one (step, value) point")
        steps = [s for s, _ in pts]
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"schedule steps must increase strictly, got {steps}")
        object.__setattr__(self, "points", pts)

    def __call__(self, step: float) -> float:
        steps = [s for s, _ in self.points]
        values = [v for _, v in self.points]
        return float(np.interp(float(step), steps, values))


Weight = float | Schedule | Sequence[tuple[float, float]]


def _as_weight(value: Weight) -> float | Schedule:
    if isinstance(value, Schedule):
        return value
    if isinstance(value, (int, float, np.floating, np.integer)):
        return float(value)
    return Schedule(tuple(value))  # type: ignore[arg-type]


@dataclass(frozen=True)
class TargetConfig:
    """What the pretraining loss predicts (SPEC.md 4.1).

    Args:
        modality_weights: modality name (``"text"``, ``"omni"``, ``"image"``, ``"audio"``, ...) -> a
            weight, a :class:`Schedule`, or a list of ``(step, value)`` points; unnamed modalities
            weigh 1.
        excluded_ids: target ids that never count (weight 0) whatever their modality.
        excluded_names: token names (``spec.id(name)``) excluded likewise.
        end_of_document: name of the end-of-document token (default ``"eos"``); the label whose
            INPUT is that token (the cross-document prediction) gets weight 0. ``None`` disables it.
    """

    modality_weights: Mapping[str, Weight] = field(default_factory=dict)
    excluded_ids: tuple[int, ...] = ()
    excluded_names: tuple[str, ...] = ()
    end_of_document: str | None = "eos"

    def __post_init__(self) -> None:
        object.__setattr__(self, "modality_weights", {k: _as_weight(v) for k, v in self.modality_weights.items()})
        object.__setattr__(self, "excluded_ids", tuple(int(i) for i in self.excluded_ids))
        object.__setattr__(self, "excluded_names", tuple(self.excluded_names))

    @classmethod
    def preset(cls, name: str, spec: VocabSpec | None = None) -> TargetConfig:
        """The report's stage presets (section 3.2, Table 2).

        ``"all"`` (stage 1): every modality is predicted, the omni markers included. ``"text-only"``
        (stage 2 on, every long-context step): only text is predicted: every id at or above the text
        range weighs 0 (the omni block, so the image and audio structure markers and placeholders, and
        every content-code block, a plugin's included), and the task-control markers
        (``spec.task_markers``) are excluded by name as well, so that a modality weight given on top
        (``--apertus-modality-weight omni=1``) still never makes them targets.
        """
        spec = spec or default_spec()
        if name == "all":
            return cls()
        if name == "text-only":
            return cls(
                modality_weights={name: 0.0 for name in spec.modality_names if name != "text"},
                excluded_names=spec.task_markers,
            )
        raise ValueError(f"unknown target preset {name!r}; choose 'all' or 'text-only'")

    def weights_at(self, spec: VocabSpec, step: float | None = None) -> np.ndarray:
        """float32 weight per modality index (``spec.modality_names`` order) at ``step``."""
        out = np.ones(len(spec.modality_names), dtype=np.float32)
        for k, name in enumerate(spec.modality_names):
            w = self.modality_weights.get(name)
            if w is None:
                continue
            if isinstance(w, Schedule):
                if step is None:
                    raise ValueError(f"the weight of modality {name!r} is scheduled: pass the training step")
                out[k] = w(step)
            else:
                out[k] = w
        unknown = set(self.modality_weights) - set(spec.modality_names)
        if unknown:
            raise ValueError(f"unknown modalities {sorted(unknown)}; this spec has {list(spec.modality_names)}")
        return out

    def excluded(self, spec: VocabSpec) -> np.ndarray:
        """The excluded target ids (int64, sorted)."""
        ids = set(self.excluded_ids) | {spec.id(n) for n in self.excluded_names}
        return np.array(sorted(ids), dtype=np.int64)


#: The report's prediction targets per continued-pretraining stage (section 3.2, Table 2: stage 1 all
#: modalities, stages 2 and 3 text only; section 3.3: the long-context steps continue stage 3's targets).
STAGE_TARGETS: dict[str, str] = {"1": "all", "2": "text-only", "3": "text-only", "long-context": "text-only"}


def stage_targets(stage: str | None, preset: str | None) -> str:
    """The target preset to train with: ``preset`` when given, else the report's for ``stage`` (else ``"all"``).

    A ``preset`` that contradicts the report's for ``stage`` is kept (the user asked for it) and the
    divergence is logged once (:func:`apertus_plugins.core.divergence.note`), naming the report's value.
    """
    if stage is not None and stage not in STAGE_TARGETS:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGE_TARGETS)}")
    if preset is not None and preset not in ("all", "text-only"):
        raise ValueError(f"unknown target preset {preset!r}; choose 'all' or 'text-only'")
    if stage is None:
        return preset or "all"
    report = STAGE_TARGETS[stage]
    if preset is not None and preset != report:
        from .divergence import note

        note(f"targets:{stage}:{preset}",
             f"stage {stage} trains with {preset!r} targets; the report trains stage {stage} on {report!r} targets "
             "(section 3.2, Table 2: stage 1 predicts all modalities, stages 2 and 3 and the long-context steps "
             "text only)")
    return preset or report


@dataclass(frozen=True)
class TargetWeights:
    """Per-label outputs of :func:`pretraining_targets` (length ``L-1``, or ``(B, L-1)``)."""

    weights: Any
    """float32 loss weight per label."""
    modality: Any
    """uint8 modality index per label, in ``spec.modality_names`` order (for per-modality losses)."""


def pretraining_targets(
    ids: Any,
    spec: VocabSpec | None = None,
    config: TargetConfig | str = "all",
    *,
    step: float | None = None,
    goldfish: GoldfishConfig | Mapping[str, Any] | None = None,
) -> TargetWeights:
    """Per-label loss weights and modality indices for continued pretraining (SPEC.md 4.1).

    Args:
        ids: input ids of length ``L`` (or ``(B, L)``); labels are ``ids[1:]``.
        spec: the vocabulary layout (default: the released layout, ``vocab.default_spec()``).
        config: a :class:`TargetConfig` or a preset name (``"all"``, ``"text-only"``).
        step: the training step, needed when a modality weight is scheduled.
        goldfish: a :class:`~apertus_plugins.core.goldfish.GoldfishConfig` (or a mapping of its fields
            ``k``, ``h``, ``variant``); dropped labels get weight 0. ``None`` disables Goldfish.

    Weight of label ``j`` (``ids[j+1]``): the weight of its modality at ``step``; 0 if it is an
    excluded id; 0 if its input ``ids[j]`` is the end-of-document token; 0 if Goldfish drops it.
    """
    spec = spec or default_spec()
    cfg = TargetConfig.preset(config, spec) if isinstance(config, str) else config
    arr, src = _to_numpy(ids)
    if arr.ndim not in (1, 2):
        raise ValueError(f"ids must be 1-D or 2-D, got shape {arr.shape}")
    x = _check_ids(arr, spec.size)
    labels = x[..., 1:]
    inputs = x[..., :-1]
    modality = spec.modality_of(labels)
    weights = cfg.weights_at(spec, step)[modality]
    excluded = cfg.excluded(spec)
    if excluded.size:
        weights[np.isin(labels, excluded)] = 0.0
    if cfg.end_of_document is not None:
        weights[inputs == spec.id(cfg.end_of_document)] = 0.0
    fish = GoldfishConfig.coerce(goldfish)
    if fish is not None:
        weights[fish.drop(labels, spec)] = 0.0
    return TargetWeights(weights=_like(weights.astype(np.float32, copy=False), src), modality=_like(modality, src))


def sft_targets(
    ids: Any,
    spec: VocabSpec | None = None,
    *,
    stored: Any = None,
    goldfish: GoldfishConfig | Mapping[str, Any] | None = None,
    specials: SftSpecials = "emitted",
) -> Any:
    """Which labels an SFT step trains: the SFT mask, less what Goldfish drops when it covers SFT.

    The SFT counterpart of :func:`pretraining_targets`, the one rule the SFT loaders call.

    Args:
        ids: token ids of one conversation (or a packed row), length ``L``.
        spec: the vocabulary layout (default: the released layout).
        stored: a stored mask stream for these ids (:func:`sft_mask_from_stored`, token- or
            label-aligned) instead of the derived :func:`sft_mask`.
        goldfish: Goldfish settings; applied only when ``on_sft`` is set (``--apertus-goldfish-sft``),
            since the report's SFT keeps every assistant label.
        specials: which special tokens of an assistant turn the derived mask trains (:func:`sft_mask`);
            a stored mask was written with its own choice.

    Returns:
        bool mask of length ``L-1``, like :func:`sft_mask`.
    """
    spec = spec or default_spec()
    arr, src = _to_numpy(ids)
    if stored is not None:
        keep = np.asarray(sft_mask_from_stored(stored, length=arr.shape[-1]), dtype=bool)
    else:
        keep = np.asarray(sft_mask(arr, spec, specials=specials), dtype=bool)
    fish = GoldfishConfig.coerce(goldfish)
    if fish is not None and fish.on_sft:
        keep = keep & ~np.asarray(fish.drop(arr[..., 1:], spec), dtype=bool)
    return _like(keep, src)



