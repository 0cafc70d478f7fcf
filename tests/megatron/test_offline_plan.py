"""The offline pipeline's plan: shapes from headers, bad inputs, shape-uniform deterministic batches.

No encoder runs here: planning reads headers only. Each header-derived shape is checked against
the shape the core's preprocessing really produces after decoding.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from _offline_data import workspace

from apertus_plugins.core.media.audio import load_audio, preprocess_audio, resampled_length
from apertus_plugins.core.media.image import preprocess_image
from apertus_plugins.data.offline.config import TokenizeConfig
from apertus_plugins.data.offline.plan import make_batches
from apertus_plugins.data.offline.sft import has_reasoning, strip_reasoning
from apertus_plugins.data.offline.sources import Reasons, read_media, scan_pretrain, scan_sft


def _scan_all() -> tuple[list, list, list]:
    ws = workspace()
    return scan_pretrain([str(ws.folder), str(ws.shard)], "released", "released")


def test_header_shapes_equal_decoded_shapes() -> None:
    items, _skips, _files = _scan_all()
    seen = set()
    for it in items:
        (ref,) = it.media
        data = read_media(ref)
        if ref.name.endswith("truncated.jpg") or ref.name.endswith("s005.jpg"):
            continue  # headers are fine, pixels are not: found by the worker
        if ref.kind == "image":
            pre = preprocess_image(data)
            assert [pre.height, pre.width] == ref.shape, ref.name
            assert pre.grid[0] * pre.grid[1] == ref.codes
        else:
            wave, rate = load_audio(data)
            clip = preprocess_audio(wave, rate)
            assert [clip.size] == ref.shape, ref.name
            assert ref.codes == -(-clip.size // 600)
        seen.add(ref.name.rsplit("/", 1)[-1])
    # the EXIF-rotated JPEG (stored 160 wide, decoded 160 tall), RGBA PNG, stereo 16 kHz, 44.1 kHz FLAC, tar members
    assert {"rot.jpg", "05.png", "c.wav", "d.flac", "shard-000.tar:s001.jpg", "shard-000.tar:s003.wav"} <= seen
    rot = next(it for it in items if it.name.endswith("rot.jpg"))
    assert rot.media[0].shape[0] > rot.media[0].shape[1]


@pytest.mark.parametrize("policy", ["released", "fft"])
def test_resampled_length_matches_the_resampler(policy: str) -> None:
    rng = np.random.default_rng(0)
    for rate in (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000):
        for n in (1, 7, 599, int(rng.integers(100, 5000))):
            got = preprocess_audio(rng.standard_normal(n).astype(np.float32), rate, policy)
            assert got.size == resampled_length(n, rate, policy), (rate, n)


def test_bad_inputs_are_named_with_reasons_at_plan_time() -> None:
    ws = workspace()
    items, skips, _ = _scan_all()
    by_name = {Path(s.source).name: s for s in skips}
    expected = dict(zip(ws.expected["folder"]["bad"], ws.expected["folder"]["reasons"], strict=True))
    for name, reason in expected.items():
        base = Path(name).name
        if base == "truncated.jpg":  # a truncated JPEG has a valid header: the worker finds it
            assert any(it.name.endswith(name) for it in items)
            continue
        assert by_name[base].reason == reason, by_name[base]
        assert name in by_name[base].detail  # the message names the file
    assert by_name["wide.png"].reason == Reasons.ASPECT and "205.0" in by_name["wide.png"].detail
    assert by_name["shard-000.tar:s004"].reason == Reasons.FORMAT
    assert "components: json" in by_name["shard-000.tar:s004"].detail
    good = ws.expected["folder"]["good"] + ws.expected["shard"]["good"]
    assert len(items) == len(good) + 2  # plus the two truncated JPEGs
    # captions: beside the file and in the shard
    texts = {Path(it.name).name: it.text for it in items}
    assert texts["03.png"] == "a caption for image three" and texts["shard-000.tar:s002.jpg"] == "caption 2"
    assert texts["b.wav"] == "the transcript of clip b" and texts["a.wav"] is None


def test_unreadable_and_compressed_shards(tmp_path: Path) -> None:
    import tarfile

    (tmp_path / "junk.tar").write_bytes(b"\x00" * 10 + b"not a tar" * 100)
    with tarfile.open(tmp_path / "z.tar.gz", "w:gz") as tf:
        info = tarfile.TarInfo("a.jpg")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
    items, skips, _ = scan_pretrain([str(tmp_path)], "released", "released")
    assert not items
    reasons = {Path(s.source).name: s.reason for s in skips}
    assert reasons == {"junk.tar": Reasons.TAR, "z.tar.gz": Reasons.FORMAT}


def test_batches_are_shape_uniform_complete_and_deterministic() -> None:
    items, _s, _f = _scan_all()
    items2, _s2, _f2 = _scan_all()
    assert [i.to_dict() for i in items] == [i.to_dict() for i in items2]
    for batch_size, codes, window in [(4, 65536, 4096), (2, 150, 4096), (3, 65536, 5), (1, 1, 1)]:
        batches = make_batches(items, "pretrain", batch_size, codes, window)
        assert batches == make_batches(items2, "pretrain", batch_size, codes, window)
        flat = [i for b in batches for i in b.items]
        assert sorted(flat) == list(range(len(items)))  # every item exactly once
        for b in batches:
            shapes = {(items[i].media[0].kind, tuple(items[i].media[0].shape)) for i in b.items}
            assert len(shapes) == 1, b
            assert len(b.items) <= batch_size
            assert b.codes == sum(items[i].codes for i in b.items)
            assert len(b.items) == 1 or b.codes <= codes
            assert len({i // window for i in b.items}) == 1  # never across a window
            assert b.items == sorted(b.items)  # source order inside a batch


def test_fingerprint_ignores_how_the_run_is_executed(tmp_path: Path) -> None:
    ws = workspace()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    base = TokenizeConfig("pretrain", [str(ws.folder)], out=str(tmp_path / "o"), tokenizer=str(ws.tokenizer),
                          checkpoint=str(tmp_path / "ckpt"))
    same = replace(base, workers=7, ray_address="auto", device="cuda", progress=False, keep_work=True)
    assert same.fingerprint() == base.fingerprint()
    for change in ({"image_layout": "inference"}, {"batch_size": 5}, {"precision": "tf32"}, {"captions": "before"}):
        assert replace(base, **change).fingerprint() != base.fingerprint(), change


def _sharded_plan(tmp: Path, kind: str, sources: list[str], **settings: object) -> list[list[str]]:
    """The plan as the pipeline makes it (listing, a scanning and a batching task per shard): item names per batch."""
    import json
    from dataclasses import asdict

    from apertus_plugins.data.offline import storage
    from apertus_plugins.data.offline.execute import InProcess
    from apertus_plugins.data.offline.plan import Layout
    from apertus_plugins.data.offline.run import _plan

    ws = workspace()
    (tmp / "ckpt").mkdir(exist_ok=True)
    cfg = TokenizeConfig(kind, sources, out=str(tmp / "o"), tokenizer=str(ws.tokenizer), checkpoint=str(tmp / "ckpt"),
                         workers=0, progress=False, **settings)
    layout = Layout(cfg.work)
    storage.write_json(layout.config, asdict(cfg))
    plan, _info = _plan(cfg, layout, InProcess())
    out = []
    for p, (_first, n, _items) in enumerate(plan["parts"]):
        lines = Path(layout.part_batches(p)).read_text().splitlines() if n else []
        out += [[it["name"] for it in json.loads(line)["items"]] for line in lines]
    storage.remove(cfg.work, recursive=True)
    return out


@pytest.mark.parametrize("window", [3, 4096])
def test_the_sharded_plan_is_the_plan_whatever_the_shard_size(tmp_path: Path, window: int) -> None:
    ws = workspace()
    sources = [str(ws.folder), str(ws.shard), str(ws.shard2)]
    items, _skips, _ = scan_pretrain(sources, "released", "released")
    want = [[items[i].name for i in b.items] for b in make_batches(items, "pretrain", 4, 65536, window)]
    for plan_files in (1, 2, 5, 4096):
        got = _sharded_plan(tmp_path, "pretrain", sources, batch_size=4, window=window, plan_files=plan_files)
        assert got == want, plan_files


def test_jsonl_byte_ranges_keep_every_conversation_and_its_line(tmp_path: Path) -> None:
    ws = workspace()
    items, _skips, _ = scan_sft([str(ws.conversations)], None, "released", "released")
    size = ws.conversations.stat().st_size
    for plan_bytes in (257, 4096, size - 1, size + 1):
        got = _sharded_plan(tmp_path, "sft", [str(ws.conversations)], batch_size=1, plan_bytes=plan_bytes)
        assert [names for b in got for names in b] == [it.name for it in items], plan_bytes


def test_listing_order_is_the_sorted_relative_paths(tmp_path: Path) -> None:
    import os

    from apertus_plugins.data.offline.sources import list_shards

    names = ["a.txt", "a/b.jpg", "a-b/c.png", "a.jpg", "b.JPG", ".hidden/x.jpg", "d/.h.jpg", "A.png", "a/b/c.wav",
             "a/b.txt", "z.tar.gz", "ab.jpg", "a/b0.jpg"]
    for n in names:
        (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / n).write_bytes(b"x")
    want = []
    for root, dirs, files in os.walk(tmp_path):  # the pipeline's order before it was sharded
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        want += [Path(root, f) for f in files if not f.startswith(".")]
    want = sorted(str(p.relative_to(tmp_path)) for p in want)
    for plan_files in (1, 3, 100):
        specs = list(list_shards("pretrain", [str(tmp_path)], plan_files, 1))
        got = [str(Path(f[1]).relative_to(tmp_path)) for s in specs for f in s["files"]]
        assert got == want
        assert all(len(s["files"]) <= plan_files for s in specs)
    roles = {str(Path(f[1]).relative_to(tmp_path)): (f[3], f[4]) for f in specs[0]["files"]}
    assert roles["a.txt"] == ("caption", None) and roles["a.jpg"] == ("image", str(tmp_path / "a.txt"))
    assert roles["a/b.txt"] == ("caption", None) and roles["z.tar.gz"] == ("compressed", None)


def test_scan_sft_conversations() -> None:
    ws = workspace()
    items, skips, files = scan_sft([str(ws.conversations)], None, "released", "released")
    assert [len(it.media) for it in items] == [1, 2, 2, 0, 1]  # the broken JPEG is planned (valid header)
    assert [m.kind for m in items[1].media] == ["image", "audio"]
    assert items[2].media[0].inline == [0, 0] and items[2].media[1].inline == [0, 1]
    assert items[2].media[0].shape == [128, 144] and items[2].media[1].shape == [4800]
    reasons = sorted(s.reason for s in skips)
    assert reasons == sorted([Reasons.MISSING, Reasons.REMOTE, Reasons.JSON, Reasons.FORMAT])
    missing = next(s for s in skips if s.reason == Reasons.MISSING)
    assert "missing.png" in missing.detail and "conv.jsonl:7" in missing.source
    assert str(ws.conversations.parent / "files" / "cat.png") in files


def test_has_and_strip_reasoning() -> None:
    msgs = [
        {"role": "user", "content": "q <think>user text is not reasoning</think>"},
        {"role": "assistant", "content": "<|inner_prefix|>a<|inner_suffix|>A1 <think>b</think>A2"},
        {"role": "assistant", "content": {"parts": [
            {"type": "text", "text": "x<think>c"}, {"type": "image", "image": "in.png"},
            {"type": "text", "text": "d</think>y"}, {"type": "image", "image": "out.png"}]}},
        {"role": "assistant", "content": "tail <think>never closed"},
        {"role": "assistant", "content": {"blocks": [{"type": "thoughts", "text": "t"},
                                                     {"type": "response", "text": "R"}]}},
        {"role": "assistant", "content": "plain", "reasoning_content": "why"},
    ]
    from apertus_plugins.core.chat import normalize_messages

    norm = normalize_messages(msgs)
    assert has_reasoning(norm)
    out, kept = strip_reasoning(norm)
    assert not has_reasoning(out)
    assert out[0]["content"] == msgs[0]["content"]  # user text untouched
    assert out[1]["content"] == "A1 A2"
    parts = out[2]["content"]["parts"]
    assert [p.get("text", p.get("image")) for p in parts] == ["x", "y", "out.png"]
    assert kept == [False, True]
    assert out[3]["content"] == "tail "
    assert out[4]["content"] == {"blocks": [{"type": "response", "text": "R"}]}
    assert "reasoning_content" not in out[5]
    assert not has_reasoning(normalize_messages([{"role": "assistant", "content": "no"}]))


def _chunks(png: bytes) -> list[bytes]:
    out, pos = [], 8
    while pos < len(png):
        n = int.from_bytes(png[pos : pos + 4], "big")
        out.append(png[pos : pos + 12 + n])
        pos += 12 + n
    return out


def test_png_headers_are_read_without_decoding_the_pixels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning reads headers only, PNGs too: Pillow's ``getexif`` of a PNG decodes it whole to look for an
    ``eXIf`` chunk after the pixels; the planner walks the chunks instead (and still finds a late one)."""
    import zlib

    from PIL import Image, ImageFile

    rng = np.random.default_rng(5)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: the decoded image is 160 tall, 96 wide
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (96, 160, 3), dtype=np.uint8)).save(buf, "PNG", exif=exif)
    chunks = _chunks(buf.getvalue())
    kinds = [c[4:8] for c in chunks]
    late = [c for c in chunks if c[4:8] != b"eXIf"]
    late.insert(len(late) - 1, chunks[kinds.index(b"eXIf")])  # after the pixels, before IEND
    (tmp_path / "late.png").write_bytes(buf.getvalue()[:8] + b"".join(late))
    # pixel data that does not inflate: only decoding it fails
    idat = next(c for c in chunks if c[4:8] == b"IDAT")
    junk = b"IDAT" + bytes(len(idat) - 12)
    bad = idat[:4] + junk + zlib.crc32(junk).to_bytes(4, "big")
    (tmp_path / "junk.png").write_bytes(b"".join([buf.getvalue()[:8], *[bad if c is idat else c for c in chunks]]))
    loads: list[str] = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self.format) or load(self))
    items, skips, _ = scan_pretrain([str(tmp_path)], "released", "released")
    assert not loads and not skips  # no pixel decoded while planning
    monkeypatch.undo()
    shapes = {Path(it.name).name: it.media[0].shape for it in items}
    pre = preprocess_image((tmp_path / "late.png").read_bytes())
    assert shapes["late.png"] == [pre.height, pre.width] and pre.height > pre.width
    assert shapes["junk.png"] == shapes["late.png"]  # its EXIF block comes first: orientation 6 too
