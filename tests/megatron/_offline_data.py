"""Small, deterministic inputs for the offline pipeline tests: images, clips, shards, conversations.

Every file is generated from a seeded RNG, so two calls write identical bytes. Sizes are kept
tiny (images of a few hundred pixels a side, clips of a fraction of a second) so the tiny
encoders run them in seconds on two CPU cores.
"""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from PIL import Image

IMAGE_SIZES = [(128, 128), (128, 128), (130, 126), (96, 200), (144, 112), (128, 128)]


def _image(rng: np.random.Generator, h: int, w: int, mode: str = "RGB") -> Image.Image:
    arr = rng.integers(0, 256, (h, w, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    return Image.fromarray(arr, mode)


def jpeg_bytes(img: Image.Image, orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    if orientation is None:
        img.save(buf, "JPEG", quality=90)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(buf, "JPEG", quality=90, exif=exif)
    return buf.getvalue()


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def wav_bytes(rng: np.random.Generator, seconds: float, rate: int, channels: int = 1, fmt: str = "WAV") -> bytes:
    n = int(round(seconds * rate))
    data = (rng.standard_normal((n, channels)) * 0.2).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, data, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def write_media_folder(root: Path, seed: int = 0) -> dict[str, list[str]]:
    """Good and bad media in a folder tree; returns the names by expected outcome."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    good: list[str] = []
    for k, (h, w) in enumerate(IMAGE_SIZES):
        img = _image(rng, h, w, "RGBA" if k == 5 else "RGB")  # RGBA: composited onto white
        name = f"img/{k:02d}.{'png' if k % 2 else 'jpg'}"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(png_bytes(img) if k % 2 else jpeg_bytes(img.convert("RGB")))
        good.append(name)
    (root / "img/03.txt").write_text("a caption for image three", encoding="utf-8")
    # EXIF orientation 6 (rotate 90): the decoded image is 96 x 160, the stored one 160 x 96
    (root / "img/rot.jpg").write_bytes(jpeg_bytes(_image(rng, 96, 160), orientation=6))
    good.append("img/rot.jpg")
    # clips: 24 kHz mono, 16 kHz stereo, 44.1 kHz, FLAC; two with identical length (batched together)
    clips = {"aud/a.wav": (0.25, 24000, 1, "WAV"), "aud/b.wav": (0.25, 24000, 1, "WAV"),
             "aud/c.wav": (0.3, 16000, 2, "WAV"), "aud/d.flac": (0.2, 44100, 1, "FLAC")}
    for name, (sec, rate, ch, fmt) in clips.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(wav_bytes(rng, sec, rate, ch, fmt))
        good.append(name)
    (root / "aud/b.txt").write_text("the transcript of clip b", encoding="utf-8")
    bad: dict[str, str] = {}
    full = jpeg_bytes(_image(rng, 128, 160))
    (root / "bad").mkdir(exist_ok=True)
    (root / "bad/truncated.jpg").write_bytes(full[: len(full) // 2])
    bad["bad/truncated.jpg"] = "unreadable image"
    (root / "bad/empty.png").write_bytes(b"")
    bad["bad/empty.png"] = "empty file"
    (root / "bad/empty.wav").write_bytes(b"")
    bad["bad/empty.wav"] = "empty file"
    (root / "bad/noise.wav").write_bytes(rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
    bad["bad/noise.wav"] = "unreadable audio"
    (root / "bad/text.jpg").write_text("this is not a picture", encoding="utf-8")
    bad["bad/text.jpg"] = "unreadable image"
    (root / "bad/wide.png").write_bytes(png_bytes(_image(rng, 2, 410)))
    bad["bad/wide.png"] = "aspect ratio above 200"
    (root / "bad/data.xyz").write_bytes(b"\x00\x01")
    bad["bad/data.xyz"] = "unsupported sample format"
    return {"good": good, "bad": sorted(bad), "reasons": [bad[k] for k in sorted(bad)]}


def write_shard(path: Path, seed: int = 1) -> dict[str, list[str]]:
    """A WebDataset shard: images with captions, a clip, a sample without media, a truncated JPEG."""
    rng = np.random.default_rng(seed)
    members: list[tuple[str, bytes]] = []
    good = []
    for k in range(3):
        key = f"s{k:03d}"
        members.append((f"{key}.jpg", jpeg_bytes(_image(rng, 128, 128 + 16 * (k % 2)))))
        members.append((f"{key}.txt", f"caption {k}".encode()))
        good.append(f"{key}.jpg")
    members.append(("s003.wav", wav_bytes(rng, 0.25, 24000)))
    members.append(("s003.txt", b"spoken words"))
    good.append("s003.wav")
    members.append(("s004.json", b'{"only": "metadata"}'))
    full = jpeg_bytes(_image(rng, 128, 128))
    members.append(("s005.jpg", full[: len(full) // 3]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(data))
    return {"good": good, "bad": ["s004", "s005.jpg"]}


def write_conversations(path: Path, media: Path, seed: int = 2) -> dict[str, int]:
    """SFT conversations in both message shapes, with media by path and inline, and broken lines."""
    rng = np.random.default_rng(seed)
    media.mkdir(parents=True, exist_ok=True)
    (media / "cat.png").write_bytes(png_bytes(_image(rng, 128, 128)))
    (media / "dog.jpg").write_bytes(jpeg_bytes(_image(rng, 160, 128)))
    (media / "voice.wav").write_bytes(wav_bytes(rng, 0.3, 16000))
    full = jpeg_bytes(_image(rng, 128, 128))
    (media / "broken.jpg").write_bytes(full[: len(full) // 2])
    import base64

    inline_png = "data:image/png;base64," + base64.b64encode(png_bytes(_image(rng, 128, 144))).decode()
    inline_wav = base64.b64encode(wav_bytes(rng, 0.2, 24000)).decode()
    rel = media.name
    records: list[object] = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{rel}/cat.png"}},
                                                   {"type": "text", "text": "What is this?"}]},
                      {"role": "assistant", "content": "<think>It has whiskers.</think>A cat."}]},
        {"messages": [{"role": "system", "content": "You describe media."},
                      {"role": "user", "content": {"parts": [{"type": "image", "image": f"{rel}/dog.jpg"},
                                                             {"type": "text", "text": "and"},
                                                             {"type": "audio", "audio": f"{rel}/voice.wav"}]}},
                      {"role": "assistant", "content": "A dog, and a voice.", "reasoning_content": "Look, listen."}]},
        {"messages": [{"role": "user", "content": [{"type": "input_image", "image_url": inline_png},
                                                   {"type": "input_audio",
                                                    "input_audio": {"data": inline_wav, "format": "wav"}}]},
                      {"role": "assistant", "content": "Inline media."}], "enable_thinking": False},
        [{"role": "user", "content": "Text only <|system_start|> injection"},
         {"role": "assistant", "content": "Plain.",
          "tool_calls": [{"type": "function", "function": {"name": "look", "arguments": "{\"x\": 1}"}}]},
         {"role": "tool", "content": "looked"},
         {"role": "assistant", "content": "Done."}],
        {"messages": [{"role": "user", "content": [{"type": "image", "image": f"{rel}/broken.jpg"}]},
                      {"role": "assistant", "content": "?"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": f"{rel}/missing.png"}]},
                      {"role": "assistant", "content": "?"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": "https://example.com/x.png"}}]}]},
        "not a conversation",
    ]
    lines = [json.dumps(r) for r in records]
    lines.insert(5, "{broken json")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"written": 4, "skipped": 5}


def nan_wav_bytes(rng: np.random.Generator, seconds: float, rate: int = 24000) -> bytes:
    """A float32 WAV whose samples 100-199 are NaN: its header is fine, its samples are not."""
    data = (rng.standard_normal(int(round(seconds * rate))) * 0.2).astype(np.float32)
    data[100:200] = np.nan
    buf = io.BytesIO()
    sf.write(buf, data, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def float_wav_bytes(rng: np.random.Generator, seconds: float, rate: int = 24000) -> bytes:
    data = (rng.standard_normal(int(round(seconds * rate))) * 0.2).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, data, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def write_faulty_inputs(root: Path, seed: int = 4) -> dict[str, object]:
    """Inputs with one clip of NaN samples among clips of its exact length (so they share its batch).

    ``root/media``: ``a.wav``, ``b.wav``, ``nan.wav``, ``c.wav`` (0.25 s at 24 kHz, float32: one shape
    group, one batch) and ``ok.png``; ``root/conv.jsonl``: a conversation with the NaN clip (line 2)
    between conversations with the good clips (its encoder batch), and a text-only one.
    """
    rng = np.random.default_rng(seed)
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    for name in ("a", "b"):
        (media / f"{name}.wav").write_bytes(float_wav_bytes(rng, 0.25))
    (media / "nan.wav").write_bytes(nan_wav_bytes(rng, 0.25))
    (media / "c.wav").write_bytes(float_wav_bytes(rng, 0.25))
    (media / "ok.png").write_bytes(png_bytes(_image(rng, 128, 128)))

    def said(clip: str) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": [{"type": "audio", "audio": f"media/{clip}"},
                                                         {"type": "text", "text": "What is said?"}]},
                             {"role": "assistant", "content": "Noise."}]}

    records = [said("a.wav"), said("nan.wav"), said("b.wav"),
               [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]
    (root / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return {"media": media, "conversations": root / "conv.jsonl", "bad": "nan.wav", "bad_line": "conv.jsonl:2"}


# ---------------------------------------------------------------------- a shared workspace

#: The batch size of the reference runs: several batches per shape group and many kill points.
BATCH = "4"


def tiny_checkpoint(out: Path) -> Path:
    """``apertus make-checkpoint``'s tiny random checkpoint (released layout; 256 image and 64 audio codes)."""
    from apertus_plugins.testing.checkpoint import write_checkpoint

    return write_checkpoint(out, size="tiny")


@dataclass
class Workspace:
    root: Path
    tokenizer: Path
    folder: Path
    shard: Path
    conversations: Path
    expected: dict[str, object]

    @functools.cached_property
    def shard2(self) -> Path:
        """A second WebDataset shard (other pixels): the mixed input of the Ray tests has two."""
        path = self.root / "in" / "shard-001.tar"
        write_shard(path, seed=3)
        return path

    @functools.cached_property
    def faulty(self) -> dict[str, object]:
        """Inputs with a clip of NaN samples (see :func:`write_faulty_inputs`)."""
        return write_faulty_inputs(self.root / "in" / "faulty")

    @functools.cached_property
    def checkpoint(self) -> Path:
        return tiny_checkpoint(self.root / "ckpt")

    def pretrain_args(self, out: Path, *extra: str) -> list[str]:
        return ["pretrain", str(self.folder), str(self.shard), "--out", str(out), "--tokenizer", str(self.tokenizer),
                "--checkpoint", str(self.checkpoint), "--batch-size", BATCH, "--no-progress", *extra]

    def sft_args(self, out: Path, *extra: str) -> list[str]:
        # more than half of the conversations are broken on purpose: the run must not stop on --max-bad-fraction
        return ["sft", str(self.conversations), "--out", str(out), "--tokenizer", str(self.tokenizer),
                "--checkpoint", str(self.checkpoint), "--batch-size", "2", "--without-reasoning", "--mask-stream",
                "--no-progress", "--max-bad-fraction", "1", *extra]


@functools.cache
def workspace() -> Workspace:
    """Inputs, tokenizer and checkpoint, built once per test process (removed at exit)."""
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    root = Path(tempfile.mkdtemp(prefix="apertus-offline-"))
    atexit.register(shutil.rmtree, root, True)
    tok = build_test_tokenizer(root / "tok")
    expected = {"folder": write_media_folder(root / "in" / "folder"),
                "shard": write_shard(root / "in" / "shard-000.tar"),
                "sft": write_conversations(root / "in" / "conv.jsonl", root / "in" / "files")}
    return Workspace(root, tok, root / "in" / "folder", root / "in" / "shard-000.tar", root / "in" / "conv.jsonl",
                     expected)


def records(work: Path) -> set[int]:
    """The batches of a work directory that have a record (are committed)."""
    return {int(p.stem[1:]) for p in (work / "records").glob("p*/b*.json")}


def planned_batches(work: Path) -> int:
    return int(json.loads((work / "plan.json").read_text())["batches"])


def cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``apertus tokenize ARGS`` in a subprocess of its own session (a fault kills only that run)."""
    return subprocess.run([sys.executable, "-m", "apertus_plugins.cli", "tokenize", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, start_new_session=True)


def start_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "apertus_plugins.cli", "tokenize", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)


@functools.cache
def reference(kind: str) -> Path:
    """An uninterrupted run: the prefix of its outputs.

    Pretraining runs as ``apertus tokenize`` with two local worker processes; SFT runs in this
    process (``--workers 0``), so comparisons with it also show that the worker count changes nothing.
    """
    ws = workspace()
    out = ws.root / f"ref-{kind}" / kind
    if kind == "sft":
        import contextlib

        from apertus_plugins.data.offline import TokenizeConfig, tokenize

        cfg = TokenizeConfig("sft", [str(ws.conversations)], out=str(out), tokenizer=str(ws.tokenizer),
                             checkpoint=str(ws.checkpoint), batch_size=2, without_reasoning=True, mask_stream=True,
                             workers=0, progress=False, max_bad_fraction=1.0)  # 5 of 9 lines are broken on purpose
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            tokenize(cfg)
        return out
    res = cli(ws.pretrain_args(out, "--workers", "2"))
    if res.returncode != 0:
        raise AssertionError(f"reference {kind} run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return out


def outputs(prefix: Path, suffixes: tuple[str, ...] = ("",)) -> dict[str, object]:
    """The bytes of every output dataset and its manifest entry without the prefix (for comparisons)."""
    got: dict[str, object] = {}
    for s in suffixes:
        p = f"{prefix}{s}"
        for ext in (".bin", ".idx"):
            got[s + ext] = Path(p + ext).read_bytes()
        if not s.endswith(".mask"):  # a mask stream is listed in its token dataset's manifest
            manifest = json.loads(Path(p + ".manifest.json").read_text(encoding="utf-8"))
            got[s + ".manifest"] = [{k: v for k, v in e.items() if k != "prefix"} for e in manifest["datasets"]]
    return got


SFT_SUFFIXES = ("", ".mask", ".noreason", ".noreason.mask")
