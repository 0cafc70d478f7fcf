"""The offline pipeline end to end with the tiny random encoders.

* The merged dataset is read by megatron-core's own ``IndexedDataset``: int32, one sequence per
  document, one document per written item, in plan order.
* Every document equals what the encoders produce for that item alone (``encoders.image_ids`` /
  ``audio_ids``, no batching) laid out by the core, so batching by shape changed nothing.
* Bad inputs are skipped, counted and named; the report's token counts equal the dataset's.
* The image layout is recorded in the manifest and is what the documents use; both layouts.
* SFT: conversations equal ``ChatTokenizer.encode_conversation`` with the media sequences, the
  copy without reasoning and the stored masks equal the core's ``sft_mask``.
* A finished run is recognised; changed settings are refused. (Worker count and Ray: see the resume
  and Ray tests, which compare other schedules with these references byte for byte.)
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from _offline_data import cli, reference, workspace

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

from apertus_plugins.core.chat import ChatTokenizer, MediaItem, normalize_messages, reasoning_as_blocks
from apertus_plugins.core.media.image import detect_image_layout
from apertus_plugins.core.targets import sft_mask
from apertus_plugins.data.indexed import IndexedDataset
from apertus_plugins.data.manifest import verify_manifest
from apertus_plugins.data.offline import TokenizeConfig, tokenize
from apertus_plugins.data.offline.plan import make_batches
from apertus_plugins.data.offline.sft import has_reasoning, strip_reasoning
from apertus_plugins.data.offline.sources import read_media, scan_pretrain, scan_sft


@pytest.fixture(scope="module")
def encoders() -> tuple:
    from apertus_plugins.encoders import load_audio_tokenizer, load_vision_tokenizer

    ckpt = workspace().checkpoint
    return load_vision_tokenizer(ckpt), load_audio_tokenizer(ckpt)


def _expected_pretrain(encoders: tuple, layout: str = "training", sources: list[str] | None = None) -> list[np.ndarray]:
    """Documents of the pretraining inputs, each item encoded alone, in plan order."""
    from apertus_plugins.core.media.audio import transcription_sequence
    from apertus_plugins.encoders import audio_ids, image_ids

    ws = workspace()
    chat = ChatTokenizer(ws.tokenizer)
    spec = chat.spec
    items, _skips, _ = scan_pretrain(sources or [str(ws.folder), str(ws.shard)], "released", "released")
    docs = []
    for b in make_batches(items, "pretrain", 4, 65536, 4096):
        for i in b.items:
            it = items[i]
            (ref,) = it.media
            if ref.name.endswith(("truncated.jpg", "s005.jpg")):
                continue
            data = read_media(ref)
            if ref.kind == "image":
                body = image_ids(encoders[0], data, spec, layout=layout, text_ids=chat.char_ids)
                if it.text:
                    body = np.concatenate([body, chat.text_ids(it.text)])
            else:
                seq = audio_ids(encoders[1], data, spec)
                if it.text:
                    codes = seq[1:-1] - spec.modality("audio").offset
                    body = transcription_sequence(codes, chat.text_ids(it.text), spec, "transcribe")
                else:
                    body = seq
            docs.append(np.concatenate([[spec.bos_id], body, [spec.eos_id]]))
    return docs


def test_pretrain_output_is_megatron_readable_and_exact(encoders: tuple) -> None:
    prefix = reference("pretrain")
    ws = workspace()
    mc = MegatronIndexedDataset(str(prefix))
    assert mc.index.dtype == np.int32
    expected = _expected_pretrain(encoders)
    assert len(mc) == len(expected) == len(mc.document_indices) - 1  # one sequence per document
    assert np.array_equal(mc.document_indices, np.arange(len(expected) + 1))
    for d, want in enumerate(expected):
        assert np.array_equal(mc[d], want.astype(np.int32)), d
    spec = ChatTokenizer(ws.tokenizer).spec
    layouts = {detect_image_layout(mc[d], spec) for d in range(len(mc))}
    assert layouts == {"training", None}  # images in the training layout; audio documents have none


def test_pretrain_report_and_manifest() -> None:
    prefix = reference("pretrain")
    ws = workspace()
    report = json.loads(Path(f"{prefix}.report.json").read_text())
    good = ws.expected["folder"]["good"] + ws.expected["shard"]["good"]
    bad = ws.expected["folder"]["bad"]
    assert report["items"] == {"total": len(good) + len(bad) + 2, "written": len(good), "skipped": len(bad) + 2}
    named = {Path(s["source"]).name: s["reason"] for s in report["skipped"]}
    for name, reason in zip(bad, ws.expected["folder"]["reasons"], strict=True):
        assert named[Path(name).name] == reason
    assert named["shard-000.tar:s005.jpg"] == "unreadable image"  # a truncated JPEG inside a shard
    assert named["shard-000.tar:s004"] == "unsupported sample format"
    assert report["skipped_by_reason"]["unreadable image"] == 3
    ds = IndexedDataset(prefix)
    spec = ChatTokenizer(ws.tokenizer).spec
    counts = np.zeros(len(spec.modality_names), dtype=np.int64)
    for d in range(ds.num_documents):
        counts += np.bincount(spec.modality_of(ds.document(d)), minlength=counts.size)
    assert report["tokens"] == dict(zip(spec.modality_names, counts.tolist(), strict=True), total=int(counts.sum()))
    assert report["media"] == {"audio": 5, "image": 10}
    assert "training layout" in report["layout_note"]
    manifest = verify_manifest(f"{prefix}.manifest.json", [str(prefix)])
    meta = manifest["datasets"][0]["metadata"]
    assert meta["image_layout"] == "training" and meta["serving_image_layout"] == "inference"
    assert meta["kind"] == "pretrain" and meta["dtype"] == "int32"
    assert not Path(f"{prefix}.work").exists()  # removed after success


def test_inference_layout(tmp_path: Path, encoders: tuple) -> None:
    ws = workspace()
    imgs = str(ws.folder / "img")
    cfg = TokenizeConfig("pretrain", [imgs], out=str(tmp_path / "inf"), tokenizer=str(ws.tokenizer),
                         checkpoint=str(ws.checkpoint), image_layout="inference", batch_size=4, workers=0,
                         progress=False)
    report = tokenize(cfg, out=open("/dev/null", "w"))  # noqa: SIM115
    assert report["layout_note"] is None and report["items"]["written"] == 7
    ds = IndexedDataset(tmp_path / "inf")
    spec = ChatTokenizer(ws.tokenizer).spec
    expected = _expected_pretrain(encoders, "inference", [imgs])
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == [e.tolist() for e in expected]
    assert {detect_image_layout(ds.document(d), spec) for d in range(ds.num_documents)} == {"inference"}
    meta = json.loads(Path(f"{tmp_path / 'inf'}.manifest.json").read_text())["datasets"][0]["metadata"]
    assert meta["image_layout"] == "inference"


def test_media_cache_second_run_encodes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = workspace()
    imgs = str(ws.folder / "img")
    common = dict(tokenizer=str(ws.tokenizer), checkpoint=str(ws.checkpoint), batch_size=4, workers=0, progress=False)
    plain = tokenize(TokenizeConfig("pretrain", [imgs], out=str(tmp_path / "plain"), **common), out=io.StringIO())
    assert plain["run"]["media_cache"] is None  # off by default
    cache = tmp_path / "codes"
    log = io.StringIO()
    cold = tokenize(TokenizeConfig("pretrain", [imgs], out=str(tmp_path / "a"), media_cache=str(cache), **common),
                    out=log)
    mc = cold["run"]["media_cache"]
    assert mc["misses"] > 0 and mc["hits"] + mc["misses"] == 7
    assert f"media cache: {mc['hits']} items from the cache, {mc['misses']} encoded" in log.getvalue()
    monkeypatch.setenv("APERTUS_MEDIA_CACHE", str(cache))  # the environment variable: the same cache
    warm = tokenize(TokenizeConfig("pretrain", [imgs], out=str(tmp_path / "b"), **common), out=io.StringIO())
    assert warm["run"]["media_cache"] == {"hits": 7, "misses": 0}  # the encoders ran on no item
    for name in ("a", "b"):
        assert Path(f"{tmp_path / name}.bin").read_bytes() == Path(f"{tmp_path / 'plain'}.bin").read_bytes()
        assert Path(f"{tmp_path / name}.idx").read_bytes() == Path(f"{tmp_path / 'plain'}.idx").read_bytes()


def test_audio_tasks_and_captions_before(tmp_path: Path, encoders: tuple) -> None:
    import io

    from apertus_plugins.encoders import audio_ids

    ws = workspace()
    chat = ChatTokenizer(ws.tokenizer)
    spec = chat.spec
    cfg = TokenizeConfig("pretrain", [str(ws.folder / "aud")], out=str(tmp_path / "a"), tokenizer=str(ws.tokenizer),
                         checkpoint=str(ws.checkpoint), audio_task="translate", bos=False, eos=False, workers=0,
                         progress=False, max_bad_fraction=1.0)  # three of the four clips have no transcript
    report = tokenize(cfg, out=io.StringIO())
    assert report["items"] == {"total": 4, "written": 1, "skipped": 3}
    assert report["skipped_by_reason"] == {"no transcript": 3}
    (doc,) = [IndexedDataset(tmp_path / "a").document(0)]
    codes = audio_ids(encoders[1], ws.folder / "aud" / "b.wav", spec)
    want = np.concatenate([codes, [spec.id("stt_translate")], chat.text_ids("the transcript of clip b")])
    assert doc.tolist() == want.tolist()  # no BOS/EOS with --no-bos/--no-eos
    cfg = TokenizeConfig("pretrain", [str(ws.folder / "img" / "03.png")], out=str(tmp_path / "c"),
                         tokenizer=str(ws.tokenizer), checkpoint=str(ws.checkpoint), captions="before", workers=0,
                         progress=False)
    tokenize(cfg, out=io.StringIO())
    doc = IndexedDataset(tmp_path / "c").document(0)
    caption = chat.text_ids("a caption for image three")
    assert doc[1 : 1 + len(caption)].tolist() == caption and doc[1 + len(caption)] == spec.id("img_start")


def _expected_sft(encoders: tuple) -> tuple[list[np.ndarray], list[np.ndarray]]:
    from apertus_plugins.data.offline.sources import parse_record
    from apertus_plugins.encoders import audio_ids, image_ids

    ws = workspace()
    chat = ChatTokenizer(ws.tokenizer)
    items, _skips, _ = scan_sft([str(ws.conversations)], None, "released", "released")
    main, copy = [], []
    for it in items:
        if any(m.name.startswith(str(ws.conversations.parent / "files" / "broken.jpg")) for m in it.media):
            continue
        path, off, n = it.record
        raw = Path(path).read_bytes()[off : off + n]
        messages, tools, thinking = parse_record(raw, it.name)
        messages = reasoning_as_blocks(messages)  # OpenAI-style reasoning becomes thoughts blocks (README)
        norm = normalize_messages(messages)

        def media_bytes(ref, norm=norm) -> bytes:
            if ref.inline is None:
                return read_media(ref)
            import base64

            part = norm[ref.inline[0]]["content"]["parts"][ref.inline[1]]
            value = part.get("image_url") or part["input_audio"]["data"]
            return base64.b64decode(value.split(",", 1)[1] if value.startswith("data:") else value)

        media = []
        for ref in it.media:
            data = media_bytes(ref)
            ids = (image_ids(encoders[0], data, chat.spec, layout="training", text_ids=chat.char_ids)
                   if ref.kind == "image" else audio_ids(encoders[1], data, chat.spec))
            media.append(MediaItem(ref.kind, ids))
        enable = has_reasoning(norm) if thinking is None else thinking
        main.append(chat.encode_conversation(messages, tools=tools, enable_thinking=enable, variant="training",
                                             media=media).ids)
        stripped, kept = strip_reasoning(norm)
        copy.append(chat.encode_conversation(stripped, tools=tools, enable_thinking=False, variant="training",
                                             media=[m for m, k in zip(media, kept, strict=True) if k]).ids)
    return main, copy


def test_sft_outputs(encoders: tuple) -> None:
    prefix = reference("sft")
    ws = workspace()
    spec = ChatTokenizer(ws.tokenizer).spec
    main, copy = _expected_sft(encoders)
    assert len(main) == ws.expected["sft"]["written"] == 4
    for suffix, want in (("", main), (".noreason", copy)):
        mc = MegatronIndexedDataset(f"{prefix}{suffix}")
        assert len(mc) == len(want) and mc.index.dtype == np.int32
        for d, ids in enumerate(want):
            assert np.array_equal(mc[d], ids.astype(np.int32)), (suffix, d)
        masks = MegatronIndexedDataset(f"{prefix}{suffix}.mask")
        assert masks.index.dtype == np.uint8
        for d, ids in enumerate(want):
            assert masks[d][0] == 0 and np.array_equal(masks[d][1:].astype(bool), sft_mask(ids, spec)), d
    # reasoning: the first two conversations reason; the copy has no thinking span and no enabled deliberation
    chat = ChatTokenizer(ws.tokenizer)
    text = [chat.decode(ids) for ids in main]
    plain = [chat.decode(ids) for ids in copy]
    assert "Deliberation: enabled" in text[0] and "<|inner_prefix|>It has whiskers." in text[0]
    assert "Deliberation: enabled" in text[1] and "Look, listen." in text[1]
    assert "Deliberation: disabled" in text[2]  # the record says enable_thinking: false
    assert all("Deliberation: disabled" in t and "<|inner_prefix|>" not in t for t in plain)
    assert spec.id("system_start") not in main[3][5:].tolist()  # an injection attempt stays text
    report = json.loads(Path(f"{prefix}.report.json").read_text())
    assert report["items"]["skipped"] == ws.expected["sft"]["skipped"]
    reasons = {s["reason"] for s in report["skipped"]}
    assert reasons == {"unreadable image", "missing file", "remote media not fetched", "invalid JSON",
                       "unsupported sample format"}
    broken = next(s for s in report["skipped"] if s["reason"] == "unreadable image")
    assert "broken.jpg" in broken["detail"] and "conv.jsonl:5" in broken["source"]
    for s in ("", ".noreason"):
        m = verify_manifest(f"{prefix}{s}.manifest.json", [f"{prefix}{s}", f"{prefix}{s}.mask"])
        assert [e["metadata"]["reasoning"] for e in m["datasets"]] == ["removed" if s else "kept"] * 2
        assert [e["metadata"]["dtype"] for e in m["datasets"]] == ["int32", "uint8"]


def test_finished_run_is_recognised_and_changed_settings_refused(tmp_path: Path) -> None:
    import io

    from apertus_plugins.data.offline import RunError

    ws = workspace()
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
                         + "\n", encoding="utf-8")
    out = tmp_path / "t"
    cfg = TokenizeConfig("sft", [str(text_only)], out=str(out), tokenizer=str(ws.tokenizer), workers=0,
                         progress=False)
    first = tokenize(cfg, out=io.StringIO())
    before = Path(f"{out}.bin").stat().st_mtime_ns
    log = io.StringIO()
    assert tokenize(cfg, out=log) == first and "already complete" in log.getvalue()
    assert Path(f"{out}.bin").stat().st_mtime_ns == before
    other = TokenizeConfig("sft", [str(text_only)], out=str(out), tokenizer=str(ws.tokenizer), workers=0,
                           progress=False, mask_stream=True)
    with pytest.raises(RunError, match="--restart"):
        tokenize(other, out=io.StringIO())
    res = cli(["sft", str(text_only), "--out", str(out), "--tokenizer", str(ws.tokenizer), "--mask-stream"])
    assert res.returncode == 1 and "apertus tokenize: error:" in res.stderr and "--restart" in res.stderr
    other.restart = True
    tokenize(other, out=io.StringIO())
    assert Path(f"{out}.mask.bin").is_file()


def test_media_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    ws = workspace()
    res = cli(["pretrain", str(ws.folder / "img"), "--out", str(tmp_path / "x"), "--tokenizer", str(ws.tokenizer),
               "--no-progress"])
    assert res.returncode == 1 and "--checkpoint" in res.stderr and "image" in res.stderr


@pytest.mark.parametrize("mask", ["derive", "stored"])
def test_megatron_adapter_trains_on_the_sft_output(tmp_path: Path, mask: str, process_group: None) -> None:
    """The Megatron adapter's SFT dataset (megatron-core's builder) packs the pipeline's conversations with the
    core's mask, derived or read from the stored stream (after its preflight checks the run's manifest)."""
    import argparse

    from conftest import null_tokenizer

    from megatron_patches.arguments import add_apertus_args, options_from_args
    from megatron_patches.dataset import ApertusDatasetConfig, build_datasets
    from megatron_patches.training import data_prefixes, preflight

    ws = workspace()
    prefix = str(reference("sft"))
    spec = ChatTokenizer(ws.tokenizer).spec
    parser = add_apertus_args(argparse.ArgumentParser())
    # the run's manifest lists the tokens with their mask stream: the exact list of a stage with stored masks
    manifest = ["--apertus-manifest", f"{prefix}.manifest.json"] if mask == "stored" else []
    opts = options_from_args(parser.parse_args([
        "--apertus-tokenizer", str(ws.tokenizer), "--apertus-sft-data", prefix, "--apertus-sft-mask", mask,
        *manifest]))
    preflight(opts, data_prefixes(([prefix], [1.0]), None), embedding_rows=spec.size)
    config = ApertusDatasetConfig(random_seed=7, sequence_length=1024, blend=([prefix], [1.0]), split="100,0,0",
                                  tokenizer=null_tokenizer(spec.size), create_attention_mask=False,
                                  path_to_cache=str(tmp_path / "cache"), mid_level_dataset_surplus=0.5, apertus=opts)
    train, _valid, _test = build_datasets(config, [4, 0, 0])
    convs = {tuple(IndexedDataset(prefix).document(d).tolist()) for d in range(4)}
    found = 0
    for i in range(len(train)):
        s = train[i]
        ids = np.concatenate([s["tokens"].numpy(), s["labels"].numpy()[-1:]])
        keep = s["loss_mask"].numpy()
        pos = s["position_ids"].numpy()
        starts = np.flatnonzero(pos == 0).tolist() + [pos.size]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            seg = ids[a:b]
            conv = next((c for c in convs if len(c) <= seg.size and tuple(seg[: len(c)].tolist()) == c), None)
            if conv is None:
                assert not keep[a:b].any()  # padding
                continue
            n = len(conv)
            assert keep[a:a + n - 1].tolist() == sft_mask(np.asarray(conv), spec).astype(np.float32).tolist()
            found += 1
    assert found >= 4
