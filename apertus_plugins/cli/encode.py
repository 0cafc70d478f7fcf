"""``apertus encode --checkpoint DIR FILE...``: codebook indices of images and audio files, one JSON line each.

Each line is ``{"file": ..., "modality": "image"|"audio", "grid": [rows, cols] (images only),
"codes": [...]}`` with the codebook indices in row-major order, before the vocabulary offset. The
modality is read from the file's content (Pillow, then soundfile); preprocessing is the default
(the released processor's). Items of identical shape are batched; nothing is padded. A file that
cannot be read prints ``{"file": ..., "error": ...}`` in its place, the others still print, and
the exit status is 1.

``--media-cache DIR`` (or ``APERTUS_MEDIA_CACHE=DIR``) reads stored codes from the persistent
media-code cache and encodes only the files it lacks; the counts go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "encode", help="print the image/audio codes of files (one JSON object per line)",
        description="Encode image and audio files with the checkpoint's vision and audio tokenizers and print one "
                    'JSON object per file: {"file", "modality", "grid" (images), "codes"} (codebook indices, '
                    "row-major, before the vocabulary offset). Needs torch.")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory (released layout), or a Hub id ORG/NAME[@REVISION]: only the shards "
                        "holding the encoders are fetched")
    p.add_argument("--batch-size", type=int, default=8, help="most same-shape items per forward pass")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["float32", "tf32"], default="float32")
    p.add_argument("--image-policy", default="released", help="resize policy (media.image.POLICIES)")
    p.add_argument("--audio-policy", default="released", help="audio policy (media.audio.AUDIO_POLICIES)")
    add_media_cache_args(p)
    p.set_defaults(func=run)


def add_media_cache_args(p: argparse.ArgumentParser) -> None:
    """``--media-cache DIR`` and ``--media-cache-size SIZE`` (the commands that encode media share them)."""
    p.add_argument("--media-cache", metavar="DIR", default=None,
                   help="persistent media-code cache: reuse the codes of images/clips encoded before (by any process) "
                        "and store new ones; '1' for ~/.cache/apertus-plugins/media-codes, '0' for off "
                        "(default: $APERTUS_MEDIA_CACHE, else off)")
    p.add_argument("--media-cache-size", metavar="SIZE", default=None,
                   help="bound on the cache's bytes on disk, least recently used entries go first "
                        "(default: $APERTUS_MEDIA_CACHE_SIZE, else 2GB)")


def media_cache(args: argparse.Namespace) -> Any:
    """The :class:`~apertus_plugins.encoders.cache.MediaCodeCache` the flags or the environment ask for, or None."""
    from apertus_plugins.encoders.cache import MediaCodeCache

    return MediaCodeCache.resolve(args.media_cache, args.media_cache_size)


def sniff_modality(path: Path) -> str:
    """``"image"`` if Pillow identifies the file, ``"audio"`` if soundfile does; else ``ValueError``."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with Image.open(path):
            return "image"
    except Image.DecompressionBombError:
        return "image"  # an image, and too large: the core's limits name it
    except (UnidentifiedImageError, OSError):
        pass
    import soundfile as sf

    try:
        sf.info(str(path))
        return "audio"
    except (RuntimeError, sf.LibsndfileError, TypeError):
        pass
    raise ValueError(f"{path}: neither an image (Pillow) nor an audio file (soundfile) this tool can read")


def _prepare(path: Path, args: argparse.Namespace) -> tuple[str, Any]:
    from apertus_plugins.core.media import audio, image

    modality = sniff_modality(path)
    if modality == "image":
        return modality, image.preprocess_image(path, args.image_policy)
    wave, rate = audio.load_audio(path)
    return modality, audio.preprocess_audio(wave, rate, args.audio_policy)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from apertus_plugins.encoders import encode_audio, encode_images, load_audio_tokenizer, load_vision_tokenizer

    try:
        cache = media_cache(args)
    except ValueError as exc:
        print(f"apertus encode: error: {exc}", file=sys.stderr)
        return 2
    prepared: list[tuple[str, Any] | Exception] = []
    for f in tqdm(args.files, desc="reading", unit="file", disable=len(args.files) < 16, file=sys.stderr):
        try:
            prepared.append(_prepare(Path(f), args))
        except (ValueError, OSError) as exc:
            prepared.append(exc)
    images = [i for i, p in enumerate(prepared) if isinstance(p, tuple) and p[0] == "image"]
    clips = [i for i, p in enumerate(prepared) if isinstance(p, tuple) and p[0] == "audio"]
    results: dict[int, dict[str, Any]] = {}
    if images:
        vision = load_vision_tokenizer(args.checkpoint, device=args.device, precision=args.precision)
        grids = encode_images(vision, [prepared[i][1] for i in images], batch_size=args.batch_size,  # type: ignore[index]
                              cache=cache)
        for i, grid in zip(images, grids, strict=True):
            results[i] = {"modality": "image", "grid": list(grid.shape), "codes": grid.ravel().tolist()}
    if clips:
        audio_tok = load_audio_tokenizer(args.checkpoint, device=args.device, precision=args.precision)
        codes = encode_audio(audio_tok, [prepared[i][1] for i in clips], batch_size=args.batch_size,  # type: ignore[index]
                             cache=cache)
        for i, c in zip(clips, codes, strict=True):
            results[i] = {"modality": "audio", "codes": c.tolist()}
    if cache is not None:
        print(f"apertus encode: {cache.summary()}", file=sys.stderr)
    failed = 0
    for i, f in enumerate(args.files):
        item = prepared[i]
        if isinstance(item, Exception):
            failed += 1
            print(json.dumps({"file": f, "error": str(item)}), flush=True)
            print(f"apertus encode: error: {item}", file=sys.stderr)
        else:
            print(json.dumps({"file": f, **results[i]}), flush=True)
    return 1 if failed else 0
