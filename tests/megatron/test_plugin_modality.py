"""A modality added by a third-party plugin goes through the offline SFT pipeline.

The example ``video`` plugin (``tests/_plugins/apertus_video``: frames coded by the checkpoint's
vision tokenizer, three markers in free omni slots) is pip-installed into a temporary folder; in a
process that sees it, ``apertus make-checkpoint`` writes a tokenizer with its markers and
``apertus tokenize sft`` turns conversations with ``video_url`` parts into a Megatron dataset. The
documents must equal the conversation encoded by the core with each video's sequence built here
from the frames' codes (each frame encoded alone), and a broken video is skipped with its reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_plugins"))
from install import install_plugin  # noqa: E402  (tests/_plugins: the example plugins and their installer)

#: Run with the plugin installed: write the checkpoint, the videos and the conversations, run the
#: pipeline through its command line, and write the expected documents (independently encoded).
SCRIPT = r'''
import io, json, subprocess, sys
from pathlib import Path
import numpy as np
from apertus_plugins.testing.checkpoint import write_checkpoint
from apertus_plugins.core.chat import ChatTokenizer, MediaItem
from apertus_plugins.encoders import encode_images, load_vision_tokenizer
from apertus_plugins.core.media.image import image_sequence, preprocess_image

root = Path(sys.argv[1])
ckpt = write_checkpoint(root / "ckpt", size="tiny")
rng = np.random.default_rng(7)
videos = {"a.npy": rng.integers(0, 256, (2, 32, 48, 3), dtype=np.uint8),
          "b.npy": rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)}
data = root / "data"
data.mkdir()
for name, frames in videos.items():
    np.save(data / name, frames)
np.save(data / "bad.npy", np.zeros((2, 30, 30, 3), dtype=np.uint8))  # not a multiple of 16
def conv(*names, text="What happens?"):
    parts = [{"type": "text", "text": text}] + [{"type": "video_url", "video_url": {"url": n}} for n in names]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "A ball rolls."}]}
records = [conv("a.npy"), conv("a.npy", "b.npy", text="Compare <|video|> them."), conv("bad.npy")]
(data / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
run = subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "tokenize", "sft", str(data / "conv.jsonl"),
                      "--out", str(root / "out" / "sft"), "--tokenizer", str(ckpt), "--checkpoint", str(ckpt),
                      "--mask-stream", "--workers", "0", "--no-progress"], capture_output=True, text=True)
from apertus_plugins import plugins
chat = ChatTokenizer(ckpt, spec=plugins.spec_from_tokenizer_dir(ckpt))  # the installed modalities, merged on top
spec = chat.spec
vision = load_vision_tokenizer(ckpt)
def sequence(name):
    frames = [encode_images(vision, [preprocess_image(f, "released").pixels])[0] for f in videos[name]]
    body = [image_sequence(c, spec, "training", text_ids=chat.char_ids) for c in frames]  # the run's layout
    return np.concatenate([[spec.id("video_start")], *body, [spec.id("video_end")]])
expected = []
for r in records[:2]:
    names = [p["video_url"]["url"] for p in r["messages"][0]["content"] if p["type"] == "video_url"]
    enc = chat.encode_conversation(r["messages"], variant="training", media=[MediaItem("video", sequence(n)) for n in names])
    expected.append(enc.ids.tolist())
from apertus_video import probe
codes = {n: probe((data / n).read_bytes())[1] for n in videos}
print(json.dumps({"codes": codes, "rc": run.returncode, "stderr": run.stderr[-3000:], "expected": expected,
                  "ids": {n: spec.id(n) for n in ("video", "video_start", "video_end", "img_start", "user_start")},
                  "image_codes": [spec.modalities[0].offset, spec.modalities[0].end]}))
'''


def test_plugin_video_modality_through_the_offline_sft_pipeline(tmp_path: Path) -> None:
    env = install_plugin(tmp_path / "site")
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0, got["stderr"]
    prefix = tmp_path / "out" / "sft"
    docs = MegatronIndexedDataset(str(prefix))
    assert len(docs) == 2
    ids = got["ids"]
    lo, hi = got["image_codes"]
    for d, want in enumerate(got["expected"]):
        doc = docs[d].astype(np.int64)
        assert doc.tolist() == want, d
        n_videos = d + 1
        assert (doc == ids["video_start"]).sum() == (doc == ids["video_end"]).sum() == n_videos
        assert (doc == ids["video"]).sum() == 0  # every placeholder expanded
        frames = 2 if d == 0 else 5
        assert (doc == ids["img_start"]).sum() == frames
        n_codes = got["codes"]["a.npy"] + (got["codes"]["b.npy"] if d else 0)
        assert ((doc >= lo) & (doc < hi)).sum() == n_codes  # the planner's count is the documents' count
    # the second conversation's user text holds the placeholder literal: it stays text
    second = docs[1].astype(np.int64).tolist()
    assert second.count(ids["video_start"]) == 2
    report = json.loads(Path(f"{prefix}.report.json").read_text())
    assert report["items"]["skipped"] == 1
    (skip,) = report["skipped"]
    assert skip["reason"] == "unreadable media" and "bad.npy" in skip["detail"] and "multiple of 16" in skip["detail"]
    masks = MegatronIndexedDataset(f"{prefix}.mask")
    assert len(masks) == 2
