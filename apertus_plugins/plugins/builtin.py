"""The built-in image and audio modalities, registered through the plugin hooks.

They take the path a third-party modality takes (:mod:`apertus_plugins.plugins`); their
sequence builders are the core's media functions.
"""

from __future__ import annotations

from typing import Any

from .hooks import Modality, hookimpl


def _image_sequence(codes: Any, spec: Any, layout: str = "inference", **kw: Any) -> Any:
    from apertus_plugins.core.media.image import image_sequence

    return image_sequence(codes, spec, layout=layout, **kw)


def _audio_sequence(codes: Any, spec: Any, layout: str = "default", text_ids: Any = None) -> Any:
    from apertus_plugins.core.media.audio import audio_sequence

    return audio_sequence(codes, spec)


IMAGE = Modality(
    name="image",
    codebook_size=131_072,
    placeholder="image",
    markers=("img_start", "img_end", "img_token_start", "img_end_of_row", "img_end_of_frame"),
    part_types=("image", "image_url", "input_image"),
    layouts=("inference", "training"),
    build_sequence=_image_sequence,
)

AUDIO = Modality(
    name="audio",
    codebook_size=4_096,
    placeholder="audio",
    markers=("audio_start", "audio_end"),
    part_types=("audio", "audio_url", "input_audio"),
    layouts=("default",),
    build_sequence=_audio_sequence,
    task_markers=("stt_transcribe", "stt_continue", "tts_continue"),
)


@hookimpl
def apertus_modalities() -> list[Modality]:
    return [IMAGE, AUDIO]
