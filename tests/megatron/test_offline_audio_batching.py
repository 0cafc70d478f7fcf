"""The report's audio batching (section 2.3.2) and interleaved speech-text documents (section 2.2.4).

* ``duration_batches``: every clip in exactly one batch, equal lengths in one bucket, the duration
  cap and the batch size respected, buckets shortest first; ``padded_code_counts``: a padded clip
  loses its last five codes, the longest of its batch keeps them all.
* ``apertus tokenize pretrain --audio-batching report``: each document's codes are the codes of
  its planned batch encoded as one zero-padded batch, trimmed by the rule; the longest clip of a
  batch equals its single-clip encoding; a clip that fails to decode costs only itself; a run killed
  after a batch resumes to the same bytes. The default batching is unchanged (codes = single clip).
* ``apertus tokenize interleaved``: the documents read back with megatron-core's ``IndexedDataset``
  equal the core's interleaved sequences of each recording (single-clip codes, BOS/EOS), split at
  ``--split-tokens`` into ``OUT`` and ``OUT.long``; a missing clip, an undecodable clip and an empty
  transcript each skip their recording only, named and counted; the loss targets of the core's
  ``text-only`` preset train the transcripts and not the audio codes.

The GPU-free reference for the codes is our own encoder; the transformers port's batched encoding of
the same padded batch is compared in ``tests/reference/test_reference_audio_batching.py``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from _offline_data import cli, nan_wav_bytes, workspace

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

from apertus_plugins.core.chat import ChatTokenizer
from apertus_plugins.core.media import audio
from apertus_plugins.core.targets import pretraining_targets
from apertus_plugins.data.offline.batching import AudioBatching, duration_batches, duration_buckets
from apertus_plugins.data.offline.plan import make_batches
from apertus_plugins.data.offline.sources import read_media, scan_pretrain

FAULT = "APERTUS_TOKENIZE_FAULT"
#: Clip lengths (24 kHz samples): several durations, two of equal length, one short enough to lose all codes.
CLIPS = {"c0": 4_800, "c1": 8_400, "c2": 12_000, "c3": 12_000, "c4": 19_200, "c5": 24_000, "c6": 6_480,
         "c7": 2_400}
REPORT_ARGS = ("--audio-batching", "report", "--audio-batch-seconds", "1.5", "--audio-buckets", "2")


def _wav(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sf.write(path, (rng.standard_normal(n) * 0.2).astype(np.float32), 24_000, subtype="FLOAT")


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clips")
    for k, (name, n) in enumerate(CLIPS.items()):
        _wav(root / f"{name}.wav", n, k)
    (root / "nan.wav").write_bytes(nan_wav_bytes(np.random.default_rng(9), 0.5))  # decodes to NaN: skipped
    return root


@pytest.fixture(scope="module")
def audio_tok():
    from apertus_plugins.encoders import load_audio_tokenizer

    return load_audio_tokenizer(workspace().checkpoint)


def test_duration_batches_and_the_drop_rule() -> None:
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(600, 48_000, 200)] + [24_000] * 7
    batching = AudioBatching(max_seconds=3.0, buckets=5)
    batches = duration_batches(lengths, batching, batch_size=6)
    assert sorted(p for b in batches for p in b) == list(range(len(lengths)))
    bucket = duration_buckets(lengths, 5)
    assert len(set(bucket)) == 5 and len({bucket[p] for p, n in enumerate(lengths) if n == 24_000}) == 1
    last = -1
    for b in batches:
        assert len({bucket[p] for p in b}) == 1 and bucket[b[0]] >= last  # one bucket each, shortest first
        last = bucket[b[0]]
        assert len(b) <= 6 and (len(b) == 1 or sum(lengths[p] for p in b) <= batching.max_samples)
        assert b == sorted(b)  # input order within a batch
    with pytest.raises(ValueError, match="positive"):
        AudioBatching(max_seconds=0)
    # the drop rule: padded clips lose five codes (never below zero), the longest keeps all
    assert audio.padded_code_counts([6_000, 24_000, 2_400, 24_000]) == [5, 40, 0, 40]
    assert audio.padded_code_counts([601]) == [2] and audio.padded_code_counts([]) == []


def _run(kind: str, source: Path, out: Path, **settings: object) -> dict:
    """An in-process run (``--workers 0``); its report. The resume check runs the CLI in a subprocess."""
    import contextlib
    import os

    from apertus_plugins.data.offline import TokenizeConfig, tokenize

    ws = workspace()
    cfg = TokenizeConfig(kind, [str(source)], out=str(out), tokenizer=str(ws.tokenizer), checkpoint=str(ws.checkpoint),
                         workers=0, progress=False, max_bad_fraction=1.0, **settings)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        return tokenize(cfg)


def _report_expected(clips: Path, audio_tok) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """Per clip in plan order: its length, its batch's longest, its padded-batch codes, its single-clip codes."""
    from apertus_plugins.encoders import encode_audio, encode_audio_padded

    items, _skips, _ = scan_pretrain([str(clips)], "released", "released")
    batching = AudioBatching(max_seconds=1.5, buckets=2)
    out = []
    for b in make_batches(items, "pretrain", 32, 65536, 4096, batching):
        refs = [items[i].media[0] for i in b.items if not items[i].name.endswith("nan.wav")]
        waves = [audio.preprocess_audio(*audio.load_audio(read_media(r))) for r in refs]
        longest = max(w.size for w in waves)
        for w, padded in zip(waves, encode_audio_padded(audio_tok, waves), strict=True):
            out.append((w.size, longest, padded, encode_audio(audio_tok, [w])[0]))
    return out


def test_report_batching_pads_drops_and_resumes(clips: Path, audio_tok, tmp_path: Path) -> None:
    from apertus_plugins.data.indexed import IndexedDataset

    ws = workspace()
    spec = ChatTokenizer(ws.tokenizer).spec
    offset = spec.modality("audio").offset
    base = ["pretrain", str(clips), "--tokenizer", str(ws.tokenizer), "--checkpoint", str(ws.checkpoint),
            "--no-progress", "--workers", "0", "--max-bad-fraction", "1", *REPORT_ARGS]
    out = tmp_path / "report" / "a"
    report = _run("pretrain", clips, out, audio_batching="report", audio_batch_seconds=1.5, audio_buckets=2)
    # c7 (4 codes) is padded in its batch and keeps none: skipped, named; the NaN clip fails to decode
    assert report["skipped_by_reason"] == {"no codes left after padding": 1, "unreadable audio": 1}, report["skipped"]
    assert sorted(Path(s["source"]).name for s in report["skipped"]) == ["c7.wav", "nan.wav"]
    expected = _report_expected(clips, audio_tok)
    assert sum(n < longest for n, longest, _p, _s in expected) >= 3, "too few padded clips"
    docs = [IndexedDataset(out).document(d) for d in range(IndexedDataset(out).num_documents)]
    want = [padded for _n, _l, padded, _s in expected if padded.size]
    assert len(docs) == len(want) == len(CLIPS) - 1
    for doc, codes in zip(docs, want, strict=True):
        assert doc[0] == spec.bos_id and doc[1] == spec.id("audio_start") and doc[-2] == spec.id("audio_end")
        assert (doc[2:-2] - offset).tolist() == codes.tolist()
    for n, longest, padded, single in expected:
        if n < longest:  # padded: the first ceil(n / 600) - 5 codes of the padded batch's row
            assert padded.size == max(0, audio.audio_code_count(n) - 5)
        else:  # the longest of its batch: not padded, every code kept, equal to its single-clip codes
            assert padded.tolist() == single.tolist()
    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    assert "five codes" in manifest["datasets"][0]["metadata"]["audio_padding"]

    # killed after its first batch's checkpoint, then resumed: the same bytes
    out2 = tmp_path / "resumed" / "a"
    res = cli([*base, "--out", str(out2)], {FAULT: "batch-done:0"})
    assert res.returncode == -9, res.stderr
    res = cli([*base, "--out", str(out2)])
    assert res.returncode == 0, res.stderr
    for ext in (".bin", ".idx"):
        assert Path(f"{out2}{ext}").read_bytes() == Path(f"{out}{ext}").read_bytes()

    # the default batching: every clip keeps all its codes, equal to its single-clip encoding
    out3 = tmp_path / "exact" / "a"
    _run("pretrain", clips, out3)
    ds = IndexedDataset(out3)
    got = sorted(ds.document(d)[2:-2].size for d in range(ds.num_documents))
    assert got == sorted(audio.audio_code_count(n) for n in CLIPS.values())


# ---------------------------------------------------------------------- interleaved
def _recordings(root: Path) -> tuple[Path, list[list[tuple[str, str]]]]:
    """A JSONL of recordings: four good ones (3, 1, 4 and 2 clips) and four bad ones."""
    lengths = [3_000, 4_200, 6_000, 2_400, 3_600, 4_800, 3_000, 5_400, 2_000, 3_200]
    for k, n in enumerate(lengths):
        _wav(root / f"r{k}.wav", n, 100 + k)
    (root / "garbage.wav").write_bytes(b"RIFF not really a wave file at all")
    (root / "nan.wav").write_bytes(nan_wav_bytes(np.random.default_rng(5), 0.2))
    good = [[("r0.wav", "one two"), ("r1.wav", "three"), ("r2.wav", "four five six")],
            [("r3.wav", "alone")],
            [("r4.wav", "a"), ("r5.wav", "b c"), ("r6.wav", "d"), ("r7.wav", "e f g")],
            [("r8.wav", "first"), ("r9.wav", "second")]]
    bad = [[("r0.wav", "x"), ("missing.wav", "y")],  # no such file
           [("r1.wav", "x"), ("r2.wav", "   ")],  # empty transcript
           [("garbage.wav", "x")],  # not audio
           [("r3.wav", "x"), ("nan.wav", "y")]]  # decodes to NaN samples (found when decoding)
    lines = [good[0], bad[0], good[1], bad[1], good[2], bad[2], bad[3], good[3]]
    path = root / "recordings.jsonl"
    path.write_text("".join(json.dumps({"id": f"rec{i}", "clips": [{"audio": a, "text": t} for a, t in rec]}) + "\n"
                            for i, rec in enumerate(lines)), encoding="utf-8")
    return path, good


def test_interleaved_documents_read_back_by_megatron(tmp_path: Path, audio_tok) -> None:
    from apertus_plugins.encoders import encode_audio

    ws = workspace()
    chat = ChatTokenizer(ws.tokenizer)
    spec = chat.spec
    jsonl, good = _recordings(tmp_path)
    expected: list[np.ndarray] = []
    for rec in good:
        waves = [audio.preprocess_audio(*audio.load_audio(tmp_path / a)) for a, _t in rec]
        codes = encode_audio(audio_tok, waves)
        for seq in audio.interleaved_sequences([(c, chat.text_ids(t)) for c, (_a, t) in zip(codes, rec, strict=True)],
                                               spec):
            expected.append(np.concatenate([[spec.bos_id], seq, [spec.eos_id]]))
    split = int(np.median([d.size for d in expected]))
    out = tmp_path / "out" / "inter"
    import contextlib
    import os

    from apertus_plugins.cli import main

    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # the command, in this process
        assert main(["tokenize", "interleaved", str(jsonl), "--out", str(out), "--tokenizer", str(ws.tokenizer),
                     "--checkpoint", str(ws.checkpoint), "--split-tokens", str(split), "--batch-size", "3",
                     "--workers", "0", "--no-progress", "--max-bad-fraction", "1"]) == 0
    short = MegatronIndexedDataset(str(out))
    long = MegatronIndexedDataset(f"{out}.long")
    assert short.index.dtype == np.int32 and long.index.dtype == np.int32
    assert [short[i].tolist() for i in range(len(short))] == [d.tolist() for d in expected if d.size <= split]
    assert [long[i].tolist() for i in range(len(long))] == [d.tolist() for d in expected if d.size > split]
    assert len(short) and len(long)
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["items"] == {"total": 8, "written": 4, "skipped": 4}
    assert report["skipped_by_reason"] == {"missing file": 1, "no transcript": 1, "unreadable audio": 2}
    assert sorted(s["source"].rsplit(":", 1)[1] for s in report["skipped"]) == ["2", "4", "6", "7"]
    assert any("missing.wav" in s["detail"] for s in report["skipped"])
    assert report["outputs"][str(out)]["documents"] == len(short)
    assert report["outputs"][f"{out}.long"]["documents"] == len(long)
    # the masks the core defines: with the text-only preset the transcripts train, the audio codes do not
    doc = np.asarray(short[0], np.int64)
    weights = pretraining_targets(doc, spec, "text-only").weights
    labels = doc[1:]
    is_code = spec.modality_of(labels) == spec.modality_names.index("audio")
    assert is_code.any() and not weights[is_code].any()
    text = labels < spec.text_size
    assert weights[text & (labels != spec.eos_id)].min() == 1.0


def test_interleaved_config_is_checked(tmp_path: Path) -> None:
    from apertus_plugins.data.offline import TokenizeConfig

    ws = workspace()
    with pytest.raises(ValueError, match="interleaved runs only"):
        TokenizeConfig("pretrain", ["x"], out=str(tmp_path / "o"), tokenizer=str(ws.tokenizer), split_tokens=8192)
    with pytest.raises(ValueError, match="unknown audio batching"):
        TokenizeConfig("interleaved", ["x"], out=str(tmp_path / "o"), tokenizer=str(ws.tokenizer),
                       audio_batching="padded")
