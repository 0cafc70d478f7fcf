"""SFT mask and pretraining targets against slow per-token references written from SPEC.md 4.1/4.2."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apertus_plugins.core.targets import (
    Schedule,
    TargetConfig,
    pretraining_targets,
    sft_mask,
    sft_mask_from_stored,
)
from apertus_plugins.core.vocab import VocabSpec

SPEC = VocabSpec.scaled()
FULL = VocabSpec()

TURN_OTHER = ("system_start", "system_end", "developer_start", "developer_end", "user_start", "user_end", "bos", "eos")


# ---------------------------------------------------------------------- the slow reference
def ref_state_at_start(ids: list[int], spec: VocabSpec, start: str) -> tuple[str, bool]:
    """(turn, in_tool) before ids[0]; 'auto' looks at the first turn or tool-output marker."""
    if start == "auto":
        start = "none"
        markers = {spec.id(n) for n in TURN_OTHER} | {spec.id(n) for n in (
            "assistant_start", "assistant_end", "tool_output_start", "tool_output_end")}
        for t in ids:
            if t in markers:
                if t in (spec.id("assistant_end"), spec.id("tool_output_start")):
                    start = "assistant"
                elif t == spec.id("tool_output_end"):
                    start = "tool_output"
                break
    return {"none": ("none", False), "assistant": ("assistant", False), "tool_output": ("assistant", True)}[start]


def ref_sft_mask(ids: list[int], spec: VocabSpec, start: str = "auto") -> list[bool]:
    """A plain loop over tokens, from the rule text of SPEC.md 4.2."""
    turn, tool = ref_state_at_start(ids, spec, start)
    a_start, a_end = spec.id("assistant_start"), spec.id("assistant_end")
    t_start, t_end = spec.id("tool_output_start"), spec.id("tool_output_end")
    other = {spec.id(n) for n in TURN_OTHER}
    trained = []
    for t in ids:
        ok = turn == "assistant" and not tool
        if t in (a_start, t_start, t_end) or t in other:
            ok = False  # markers, BOS/EOS and the turn markers of other roles are never targets
        if t == spec.pad_id or t >= spec.text_size:
            ok = False  # padding, omni markers, media codes
        trained.append(ok)
        if t == a_start:
            turn, tool = "assistant", False
        elif t == a_end or t in other:
            turn, tool = ("other" if t in other else "none"), False
        elif t == t_start:
            tool = True
        elif t == t_end:
            tool = False
    return trained[1:]


# ---------------------------------------------------------------------- generators
def alphabet(spec: VocabSpec) -> list[int]:
    names = TURN_OTHER + ("assistant_start", "assistant_end", "tool_output_start", "tool_output_end",
                          "inner_prefix", "inner_suffix", "tools_prefix", "tools_suffix", "pad", "unk",
                          "img_start", "img_end", "audio_start", "stt_transcribe")
    ids = [spec.id(n) for n in names]
    ids += [100, 101, 200, 300, 400]  # plain text ids of the scaled spec
    ids += [m.offset for m in spec.modalities] + [m.end - 1 for m in spec.modalities]
    return ids


ALPHA = alphabet(SPEC)


def conversation(rng: np.random.Generator, spec: VocabSpec) -> list[int]:
    """A rendered-looking conversation, sometimes broken (unclosed turns, stray markers, empty turns)."""
    I = spec.id  # noqa: E741
    text = lambda n: rng.integers(75, spec.text_size, n).tolist()  # noqa: E731
    out = [I("bos"), I("system_start"), *text(rng.integers(0, 4)), I("system_end"),
           I("developer_start"), *text(3), I("developer_end")]
    for _ in range(rng.integers(1, 4)):
        out += [I("user_start"), *text(rng.integers(0, 5))]
        if rng.random() < 0.3:
            out += [I("img_start"), *(spec.modalities[0].offset + rng.integers(0, 10, 4)).tolist(), I("img_end")]
        out += [I("user_end"), I("assistant_start")]
        if rng.random() < 0.5:
            out += [I("inner_prefix"), *text(rng.integers(0, 4))]
            if rng.random() < 0.3:
                out += [I("tools_prefix"), *text(2), I("tools_suffix"), I("tool_output_start"), *text(2),
                        I("tool_output_end")]
            out += [I("inner_suffix")]
        out += text(rng.integers(0, 5))
        if rng.random() < 0.4:
            out += [I("tools_prefix"), *text(3), I("tools_suffix"), I("tool_output_start"), *text(rng.integers(0, 4))]
            if rng.random() < 0.9:
                out.append(I("tool_output_end"))
            out += text(rng.integers(0, 3))
        if rng.random() < 0.3:
            out.append(spec.modalities[1].offset + int(rng.integers(0, 5)))  # a media code in the answer
        if rng.random() < 0.9:
            out.append(I("assistant_end"))
    if rng.random() < 0.8:
        out.append(I("eos"))
    return out


def packed(rng: np.random.Generator, spec: VocabSpec) -> list[int]:
    seq: list[int] = []
    for _ in range(rng.integers(1, 4)):
        seq += conversation(rng, spec)
    return seq


# ---------------------------------------------------------------------- SFT mask
def test_simple_turns() -> None:
    I = SPEC.id  # noqa: E741
    ids = [I("bos"), I("user_start"), 100, I("user_end"), I("assistant_start"), I("inner_prefix"), 101,
           I("inner_suffix"), 102, I("tools_prefix"), 103, I("tools_suffix"), I("tool_output_start"), 104,
           I("tool_output_end"), 105, I("assistant_end"), I("eos")]
    mask = sft_mask(ids, SPEC)
    trained = [ids[j + 1] for j in range(len(mask)) if mask[j]]
    assert trained == [I("inner_prefix"), 101, I("inner_suffix"), 102, I("tools_prefix"), 103, I("tools_suffix"),
                       105, I("assistant_end")]
    assert mask.dtype == bool and mask.shape == (len(ids) - 1,)


def test_full_size_spec_media_codes_never_trained() -> None:
    I = FULL.id  # noqa: E741
    code = FULL.modality("image").offset + 7
    ids = [I("bos"), I("assistant_start"), 100, code, I("img_end"), 101, I("assistant_end")]
    assert sft_mask(ids, FULL).tolist() == [False, True, False, False, True, True]


@pytest.mark.parametrize("seed", range(40))
def test_against_reference_random_conversations(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(50):
        ids = packed(rng, SPEC)
        for start in ("auto", "none", "assistant", "tool_output"):
            got = sft_mask(np.array(ids), SPEC, start_inside=start)
            assert got.tolist() == ref_sft_mask(ids, SPEC, start), (ids, start)


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(ALPHA), min_size=0, max_size=60),
       st.sampled_from(["auto", "none", "assistant", "tool_output"]))
def test_against_reference_adversarial(ids: list[int], start: str) -> None:
    """Arbitrary marker soup: nested and unclosed turns, markers at the edges, empty turns."""
    got = sft_mask(np.array(ids, dtype=np.int64), SPEC, start_inside=start)
    assert got.tolist() == ref_sft_mask(ids, SPEC, start)


def true_state_before(ids: list[int], a: int, spec: VocabSpec) -> str:
    turn, tool = "none", False
    for t in ids[:a]:
        if t == spec.id("assistant_start"):
            turn, tool = "assistant", False
        elif t == spec.id("assistant_end") or t in {spec.id(n) for n in TURN_OTHER}:
            turn, tool = "none", False
        elif t == spec.id("tool_output_start"):
            tool = True
        elif t == spec.id("tool_output_end"):
            tool = False
    if turn != "assistant":
        return "none"
    return "tool_output" if tool else "assistant"


@pytest.mark.parametrize("seed", range(10))
def test_truncation_with_stated_start(seed: int) -> None:
    """A window cut out of a sequence, given its start state, masks exactly as the whole did."""
    rng = np.random.default_rng(1000 + seed)
    for _ in range(50):
        ids = packed(rng, SPEC)
        full = sft_mask(np.array(ids), SPEC, start_inside="none")
        a = int(rng.integers(0, len(ids) - 1))
        b = int(rng.integers(a + 1, len(ids) + 1))
        state = true_state_before(ids, a, SPEC)
        part = sft_mask(np.array(ids[a:b]), SPEC, start_inside=state)
        assert part.tolist() == full[a : b - 1].tolist()


def test_truncated_inside_assistant_and_tool_output_auto() -> None:
    I = SPEC.id  # noqa: E741
    # starts inside an assistant turn: the first marker is <|assistant_end|>
    assert sft_mask([100, 101, I("assistant_end"), I("user_start"), 102], SPEC).tolist() == [True, True, False, False]
    # starts inside a tool output: the first marker is <|tool_output_end|>
    ids = [100, 101, I("tool_output_end"), 102, I("assistant_end")]
    assert sft_mask(ids, SPEC).tolist() == [False, False, True, True]
    # ends inside an assistant turn and inside a tool output
    ids = [I("assistant_start"), 100, I("tool_output_start"), 101]
    assert sft_mask(ids, SPEC).tolist() == [True, False, False]
    # no marker at all: nothing is trained unless the caller says so
    assert not sft_mask([100, 101, 102], SPEC).any()
    assert sft_mask([100, 101, 102], SPEC, start_inside="assistant").all()


def test_bos_eos_reset_between_packed_conversations() -> None:
    I = SPEC.id  # noqa: E741
    ids = [I("assistant_start"), 100, I("eos"), I("bos"), 101, 102, I("user_start"), 103]
    assert sft_mask(ids, SPEC).tolist() == [True, False, False, False, False, False, False]


def test_batch_and_errors() -> None:
    rng = np.random.default_rng(5)
    rows = [packed(rng, SPEC)[:30] for _ in range(4)]
    rows = [r + [100] * (30 - len(r)) for r in rows]
    batch = sft_mask(np.array(rows), SPEC)
    assert batch.shape == (4, 29)
    for r, m in zip(rows, batch, strict=True):
        assert m.tolist() == ref_sft_mask(r, SPEC)
    with pytest.raises(ValueError, match="token ids"):
        sft_mask([1, SPEC.size], SPEC)
    with pytest.raises(ValueError, match="start_inside"):
        sft_mask([1, 2], SPEC, start_inside="user")  # type: ignore[arg-type]
    assert sft_mask([5], SPEC).shape == (0,)
    assert sft_mask([], SPEC).shape == (0,)


def test_stored_mask_stream() -> None:
    stored = np.array([0, 0, 1, 1, 0, 1], dtype=np.uint8)
    assert sft_mask_from_stored(stored).tolist() == [False, True, True, False, True]
    assert sft_mask_from_stored(stored, length=6).tolist() == [False, True, True, False, True]
    assert sft_mask_from_stored(stored[1:], length=6).tolist() == [False, True, True, False, True]
    with pytest.raises(ValueError, match="stored mask"):
        sft_mask_from_stored(stored, length=9)


# ---------------------------------------------------------------------- pretraining targets
def ref_targets(ids: list[int], spec: VocabSpec, weights: dict[str, float], excluded: set[int],
                eod: int | None) -> tuple[list[float], list[int]]:
    names = spec.modality_names
    w_out, m_out = [], []
    for j in range(len(ids) - 1):
        label = ids[j + 1]
        if label < spec.text_size:
            mod = "text"
        elif label < spec.omni_offset + spec.omni_size:
            mod = "omni"
        else:
            mod = next(m.name for m in spec.modalities if m.offset <= label < m.end)
        w = weights.get(mod, 1.0)
        if label in excluded or (eod is not None and ids[j] == eod):
            w = 0.0
        w_out.append(w)
        m_out.append(names.index(mod))
    return w_out, m_out


@pytest.mark.parametrize("seed", range(10))
def test_presets_against_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for spec in (SPEC, FULL):
        ids = rng.choice(alphabet(spec) + list(range(spec.omni_offset, spec.omni_offset + 20)), 300).tolist()
        ctl = {spec.id(n) for n in spec.task_markers}
        for preset, weights, excluded in (("all", {}, set()),
                                          ("text-only", {"omni": 0.0, **{m.name: 0.0 for m in spec.modalities}},
                                           ctl)):
            out = pretraining_targets(np.array(ids), spec, preset)
            w, m = ref_targets(ids, spec, weights, excluded, spec.eos_id)
            assert out.weights.dtype == np.float32 and out.modality.dtype == np.uint8
            assert out.weights.tolist() == w
            assert out.modality.tolist() == m


def test_text_only_excludes_task_markers_and_codes() -> None:
    I = FULL.id  # noqa: E741
    ids = [100, I("stt_transcribe"), I("audio_start"), FULL.modality("audio").offset, I("tts_continue"), 200,
           I("eos"), I("bos"), FULL.modality("image").offset + 3, I("stt_continue")]
    w = pretraining_targets(ids, FULL, "text-only").weights.tolist()
    assert w == [0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert pretraining_targets(ids, FULL, "all").weights.tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 1]


def _packed_sample_with_every_marker(spec: VocabSpec) -> np.ndarray:
    """Documents of every kind the stages pack, back to back with EOS: text, an image in both layouts,
    an audio clip in each paired mode, interleaved speech-text, the placeholders, a TTS continuation."""
    from apertus_plugins.core.media.audio import (
        audio_placeholder_sequence,
        audio_sequence,
        interleaved_sequences,
        transcription_sequence,
    )
    from apertus_plugins.core.media.image import byte_text_ids, image_placeholder_sequence, image_sequence

    rng = np.random.default_rng(7)
    img = spec.modality("image").size
    aud = spec.modality("audio").size
    text = list(range(100, 120))
    clips = [(rng.integers(0, aud, 6), [101 + k, 102 + k]) for k in range(3)]
    docs = [
        [spec.bos_id, *text],
        image_sequence(rng.integers(0, img, (3, 4)), spec, "training", byte_text_ids()).tolist() + text[:5],
        image_sequence(rng.integers(0, img, (2, 2)), spec, "inference", byte_text_ids()).tolist() + text[5:9],
        *(transcription_sequence(rng.integers(0, aud, 5), text[:4], spec, task).tolist()
          for task in ("transcribe", "translate", "annotate")),
        *(seq.tolist() for seq in interleaved_sequences(clips, spec)),
        [*text[:3], spec.id("tts_continue"), *audio_sequence(rng.integers(0, aud, 4), spec).tolist()],
        [spec.id("user_start"), spec.id("image"), *image_placeholder_sequence(2, 3, spec, text_ids=byte_text_ids()).tolist(),
         *audio_placeholder_sequence(4, spec).tolist(), spec.id("user_end")],
    ]
    return np.array([i for d in docs for i in (*d, spec.eos_id)], dtype=np.int64)


@pytest.mark.parametrize("spec", [SPEC, FULL], ids=["scaled", "released"])
def test_text_only_predicts_text_only_on_packed_samples(spec: VocabSpec) -> None:
    """Report section 3.2 and Table 2: from stage 2 on only text is predicted, so every label at or above the
    text range (the omni block: image begin/end/token-start/row/frame, audio begin/end, the placeholders, the
    STT/TTS task markers; and every code) weighs 0, and every text label that does not follow an EOS weighs 1."""
    ids = _packed_sample_with_every_marker(spec)
    names = {spec.id_to_name[i] for i in ids.tolist() if spec.omni_offset <= i < spec.omni_offset + spec.omni_size}
    assert names >= {"img_start", "img_end", "img_token_start", "img_end_of_row", "img_end_of_frame", "image",
                     "audio_start", "audio_end", "stt_transcribe", "stt_translate", "audio_annotate",
                     "stt_continue", "tts_continue", "audio"}, names
    labels, inputs = ids[1:], ids[:-1]
    w = pretraining_targets(ids, spec, "text-only").weights
    assert not w[labels >= spec.text_size].any()
    text = (labels < spec.text_size) & (inputs != spec.eos_id)
    assert (w[text] == 1).all()
    # stage 1 ("all") keeps every marker and code a target: the difference is exactly the non-text labels
    w_all = pretraining_targets(ids, spec, "all").weights
    assert (w_all[labels >= spec.text_size][inputs[labels >= spec.text_size] != spec.eos_id] == 1).all()
    # a modality weight given on top of the preset (omni back to 1) still never trains the task-control markers
    cfg = TargetConfig.preset("text-only", spec)
    over = TargetConfig(modality_weights={**cfg.modality_weights, "omni": 1.0}, excluded_names=cfg.excluded_names)
    w_over = pretraining_targets(ids, spec, over).weights
    task = np.isin(labels, [spec.id(n) for n in spec.task_markers])
    assert task.any() and not w_over[task].any()
    assert w_over[(labels == spec.id("img_start")) & (inputs != spec.eos_id)].all()


def test_scheduled_weights_and_explicit_exclusions() -> None:
    sched = Schedule(((0, 1.0), (100, 0.0)))
    assert sched(-5) == 1.0 and sched(50) == 0.5 and sched(1000) == 0.0
    cfg = TargetConfig(modality_weights={"image": [(0, 1.0), (100, 0.0)], "audio": 0.25}, excluded_ids=(101,))
    img, aud = SPEC.modality("image").offset, SPEC.modality("audio").offset
    ids = [100, img, aud, 101, 102]
    out = pretraining_targets(ids, SPEC, cfg, step=25)
    assert out.weights.tolist() == [0.75, 0.25, 0.0, 1.0]
    assert [SPEC.modality_names[i] for i in out.modality] == ["image", "audio", "text", "text"]
    with pytest.raises(ValueError, match="scheduled"):
        pretraining_targets(ids, SPEC, cfg)
    with pytest.raises(ValueError, match="unknown modalities"):
        pretraining_targets(ids, SPEC, TargetConfig(modality_weights={"video": 0.0}))
    with pytest.raises(ValueError, match="preset"):
        pretraining_targets(ids, SPEC, "stage-9")
    with pytest.raises(ValueError, match="increase"):
        Schedule(((5, 1.0), (5, 2.0)))


def test_end_of_document_rule_and_goldfish_option() -> None:
    eos = SPEC.eos_id
    ids = [100, eos, 101, 102, eos, 103]
    assert pretraining_targets(ids, SPEC).weights.tolist() == [1, 0, 1, 1, 0]
    assert pretraining_targets(ids, SPEC, TargetConfig(end_of_document=None)).weights.tolist() == [1] * 5
    rng = np.random.default_rng(0)
    text = rng.integers(75, SPEC.text_size, 4000)
    from apertus_plugins.core.goldfish import goldfish_drop

    out = pretraining_targets(text, SPEC, goldfish={"k": 4, "h": 3, "variant": "order-sensitive"})
    drop = goldfish_drop(text[1:], k=4, h=3, variant="order-sensitive", spec=SPEC)
    assert drop.any()
    assert (out.weights == 0).tolist() == drop.tolist()


def test_sft_targets_is_the_sft_mask_less_goldfish_only_when_it_covers_sft() -> None:
    from apertus_plugins.core.goldfish import GoldfishConfig, goldfish_drop
    from apertus_plugins.core.targets import sft_targets

    rng = np.random.default_rng(11)
    body = rng.integers(100, 400, size=300)
    ids = np.concatenate([[SPEC.bos_id, SPEC.id("user_start"), 120, SPEC.id("user_end"), SPEC.id("assistant_start")],
                          body, [SPEC.id("assistant_end"), SPEC.eos_id]])
    derived = sft_mask(ids, SPEC)
    assert np.array_equal(sft_targets(ids, SPEC), derived)
    pretraining_only = GoldfishConfig(k=3, h=2)
    assert np.array_equal(sft_targets(ids, SPEC, goldfish=pretraining_only), derived)
    on_sft = GoldfishConfig(k=3, h=2, on_sft=True)
    dropped = goldfish_drop(ids[1:], k=3, h=2, spec=SPEC)
    want = derived & ~dropped
    assert dropped[derived].any() and np.array_equal(sft_targets(ids, SPEC, goldfish=on_sft), want)
    stored = np.zeros(ids.size, dtype=np.uint8)
    stored[10:20] = 1
    assert np.array_equal(sft_targets(ids, SPEC, stored=stored), stored[1:].astype(bool))


def test_stage_targets_follow_the_report_and_log_a_contradiction_once(caplog: pytest.LogCaptureFixture) -> None:
    """Report Table 2: stage 1 all modalities, stages 2 and 3 (and the long-context steps) text only. A preset
    that contradicts the stage runs as asked, and the divergence is logged once, naming the report's value."""
    from apertus_plugins.core.targets import STAGE_TARGETS, stage_targets

    assert STAGE_TARGETS == {"1": "all", "2": "text-only", "3": "text-only", "long-context": "text-only"}
    assert [stage_targets(s, None) for s in ("1", "2", "3", "long-context")] == ["all", "text-only", "text-only",
                                                                                  "text-only"]
    assert stage_targets(None, None) == "all" and stage_targets(None, "text-only") == "text-only"
    with caplog.at_level("WARNING", logger="apertus_plugins.report"):
        assert stage_targets("2", "text-only") == "text-only"
        assert caplog.records == []
        for _ in range(3):
            assert stage_targets("1", "text-only") == "text-only"  # kept: the user asked for it
            assert stage_targets("long-context", "all") == "all"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "stage 1" in messages[0] and "'all' targets" in messages[0] and "Table 2" in messages[0]
    assert "stage long-context" in messages[1] and "'text-only' targets" in messages[1]
    with pytest.raises(ValueError, match="unknown stage"):
        stage_targets("4", None)
    with pytest.raises(ValueError, match="preset"):
        stage_targets("1", "images")


def test_sft_specials_option() -> None:
    """Appendix G, "special tokens masked": by default (``emitted``) the tokens the assistant writes itself, the
    released stops <|assistant_end|> and <|tools_suffix|> and the call opener <|tools_prefix|>, are targets; the
    named alternative ``none`` masks every special token of the turn. The thinking delimiters are no special
    tokens: trained either way."""
    for spec in (SPEC, FULL):
        I = spec.id  # noqa: E741
        ids = [I("bos"), I("user_start"), 100, I("user_end"), I("assistant_start"), I("inner_prefix"), 101,
               I("inner_suffix"), I("tools_prefix"), 102, I("tools_suffix"), I("tool_output_start"), 103,
               I("tool_output_end"), 104, I("assistant_end"), I("eos")]
        labels = ids[1:]
        emitted = sft_mask(ids, spec).tolist()
        none = sft_mask(ids, spec, specials="none").tolist()
        trained = {spec.id_to_name.get(t, t) for t, k in zip(labels, emitted, strict=True) if k}
        assert trained == {"inner_prefix", 101, "inner_suffix", "tools_prefix", 102, "tools_suffix", 104,
                           "assistant_end"}
        trained_none = {spec.id_to_name.get(t, t) for t, k in zip(labels, none, strict=True) if k}
        assert trained_none == {"inner_prefix", 101, "inner_suffix", 102, 104}
        # the turn state is the same: only the special labels differ
        assert [a and t not in spec.special_ids for a, t in zip(emitted, labels, strict=True)] == none
    with pytest.raises(ValueError, match="specials"):
        sft_mask([1, 2], SPEC, specials="some")
