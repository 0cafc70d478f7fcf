"""``apertus demo``: the main job on the embedded test tokenizer and the bundled media.

Renders a multimodal conversation (a bundled image and audio clip, thinking, a tool call),
tokenizes it injection-safely with the media placeholders expanded into their sequences, and
prints the token layout with roles. With ``--checkpoint`` (needs torch) the tokenizer, the vision
and audio encoders come from that checkpoint and the code positions hold the codes they compute;
without it, the embedded test tokenizer is built and each code position holds the modality's
placeholder id, which is exactly what a serving processor emits before it runs the encoders.
"""

from __future__ import annotations

import argparse
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from apertus_plugins import plugins
from apertus_plugins.core.vocab import VocabSpec

if TYPE_CHECKING:
    from apertus_plugins.doctor import Report

CONVERSATION = {
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "What is in this picture, and what does the clip say? "},
            {"type": "image_url", "image_url": {"url": "demo.png"}},
            {"type": "input_audio", "input_audio": {"data": "demo.wav", "format": "wav"}},
        ]},
        {"role": "assistant", "content": {"blocks": [
            {"type": "thoughts", "text": "Look at the picture, then listen."},
            {"type": "response", "text": "A small test pattern and a short tone."}]}},
    ],
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="render and tokenize a multimodal conversation, print its layout",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", help="a tokenizer directory (default: build the embedded test tokenizer)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a released-layout checkpoint: its tokenizer and its vision/audio encoders fill in the codes "
                        "(needs torch)")
    p.add_argument("--layout", default="inference", choices=["inference", "training"], help="image layout")
    p.add_argument("--enable-thinking", action="store_true", default=True)
    p.add_argument("--serve", metavar="CHECKPOINT",
                   help="then serve CHECKPOINT with vLLM ($APERTUS_PYTHON_VLLM) and ask it about the image and clip")
    p.set_defaults(func=run)


def serve(checkpoint: str) -> int:
    """Start a vLLM server on ``checkpoint`` (plugin loaded by its entry point) and send one multimodal chat."""
    import base64

    from apertus_plugins.infra.client import http_json
    from apertus_plugins.testing.serve import CPU_ARGS, VLLMServer

    image = "data:image/png;base64," + base64.b64encode(_media_path("demo.png").read_bytes()).decode()
    clip = base64.b64encode(_media_path("demo.wav").read_bytes()).decode()
    content = [{"type": "text", "text": "What is in this picture, and what does the clip say? "},
               {"type": "image_url", "image_url": {"url": image}},
               {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]
    print(f"\n== serving {checkpoint} with vLLM (about two minutes to start on a CPU) ==", flush=True)
    with VLLMServer(checkpoint, args=[*CPU_ARGS, "--served-model-name", "apertus", "--reasoning-parser", "apertus",
                                      "--enable-auto-tool-choice", "--tool-call-parser", "apertus"]) as srv:
        status, body = http_json(srv.url("/v1/chat/completions"), {
            "model": "apertus", "messages": [{"role": "user", "content": content}], "max_tokens": 24,
            "temperature": 0, "return_token_ids": True}, timeout=600)
        report = doctor_report(checkpoint, srv.url(""))
    if status != 200:
        print(f"the server answered {status}: {body}")
        return 1
    ids = body["prompt_token_ids"]
    print(f"prompt: {len(ids)} ids (one BOS: {ids.count(ids[0]) == 1}); answer "
          f"({body['usage']['completion_tokens']} tokens, random weights):")
    print(repr(body["choices"][0]["message"]["content"]))
    return print_doctor(report)


def doctor_report(checkpoint: str, url: str | None = None) -> Report:
    """The demo's last step: ``apertus doctor CHECKPOINT --serve URL`` on the demo checkpoint and its server."""
    from apertus_plugins.doctor import run_doctor

    return run_doctor(checkpoint, serve=url, probe_tokens=64)


def print_doctor(report: Report) -> int:
    """Print the doctor's table; the demo fails when a check fails, except the degeneration probe.

    The demo's weights are random, so whether their greedy generations repeat themselves says
    nothing about the plumbing; that verdict is printed, not counted.
    """
    print(f"\n== apertus doctor {report.checkpoint}" + (f" --serve {report.serve}" if report.serve else "") + " ==")
    print(report.table())
    failed = report.ids("fail") - {"serve.degeneration"}
    if "serve.degeneration" in report.ids("fail"):
        print("(serve.degeneration fails on these random weights; it is not counted in the demo's exit code)")
    return 1 if failed else 0


def _media_path(name: str) -> Path:
    return Path(str(resources.files("apertus_plugins") / "assets" / name))


def run(args: argparse.Namespace) -> int:
    from apertus_plugins.core.chat import ChatTokenizer, MediaItem, render
    from apertus_plugins.core.media import audio as audio_mod
    from apertus_plugins.core.media import image as image_mod
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    tmp = None
    if args.checkpoint and args.tokenizer:
        raise SystemExit("apertus demo: give --checkpoint or --tokenizer, not both (a checkpoint holds its tokenizer)")
    if args.checkpoint or args.tokenizer:
        tok_dir = Path(args.checkpoint or args.tokenizer)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="apertus-demo-")
        tok_dir = build_test_tokenizer(Path(tmp.name) / "tokenizer", VocabSpec.scaled())
    spec = plugins.spec_from_tokenizer_dir(tok_dir)
    chat = ChatTokenizer(tok_dir, spec)

    img = image_mod.preprocess_image(_media_path("demo.png"))
    rows, cols = img.grid
    wave, rate = audio_mod.load_audio(_media_path("demo.wav"))
    clip = audio_mod.preprocess_audio(wave, rate)
    n_codes = audio_mod.audio_code_count(clip.shape[-1])
    if args.checkpoint:
        from apertus_plugins.encoders import encode_audio, encode_images, load_media_tokenizers

        vision, audio = load_media_tokenizers(args.checkpoint)
        grid = encode_images(vision, [img])[0]
        image_ids = image_mod.image_sequence(grid, spec, args.layout, chat.text_ids)
        audio_ids = audio_mod.audio_sequence(encode_audio(audio, [clip])[0], spec)
        source = f"codes from the encoders of {args.checkpoint}"
    else:
        image_ids = image_mod.image_placeholder_sequence(rows, cols, spec, layout=args.layout,
                                                         text_ids=chat.text_ids)
        audio_ids = audio_mod.audio_placeholder_sequence(n_codes, spec)
        source = "placeholder ids (no --checkpoint: the encoders did not run)"

    messages = CONVERSATION["messages"]
    rendered = render(messages, enable_thinking=args.enable_thinking)
    enc = chat.encode_conversation(messages, enable_thinking=args.enable_thinking,
                                   media=[MediaItem("image", image_ids), MediaItem("audio", audio_ids)])
    print("== rendered (chat template, inference variant) ==")
    print(rendered)
    print()
    print(f"== media: {source} ==\nimage {_media_path('demo.png').name}: resized to {img.height}x{img.width}, "
          f"grid {rows}x{cols} = {rows * cols} codes, {len(image_ids)} ids in the {args.layout} layout")
    print(f"audio {_media_path('demo.wav').name}: {wave.shape[-1]} samples at {rate} Hz -> "
          f"{clip.shape[-1]} at 24 kHz = {n_codes} codes, {len(audio_ids)} ids")
    print()
    print(f"== token layout ({len(enc.ids)} ids, vocabulary of {spec.size}) ==")
    print(f"{'role':10s} {'start':>5s} {'len':>5s}  first tokens")
    for role, start, stop in enc.segments():
        piece = enc.ids[start:stop]
        names = [spec.id_to_name.get(int(i)) for i in piece[:6]]
        shown = " ".join(f"<{n}>" if n else chat.decode([int(i)]) for n, i in zip(names, piece[:6], strict=True))
        more = " ..." if stop - start > 6 else ""
        print(f"{role:10s} {start:5d} {stop - start:5d}  {shown!s}{more}")
    counts = {name: int(np.sum(spec.modality_of(enc.ids) == k)) for k, name in enumerate(spec.modality_names)}
    print()
    print("ids per block: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    if tmp is not None:
        tmp.cleanup()
    return serve(args.serve) if args.serve else 0
