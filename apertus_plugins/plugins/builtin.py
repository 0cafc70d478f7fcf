"""The built-in image and audio modalities, registered through the plugin hooks.

They take the path a third-party modality takes (:mod:`apertus_plugins.plugins`); their
sequence builders are the core's media functions.
"""

from __future__ import annotations

from typing import Any

from apertus_plugins.core.vocab import BUILTIN_MEDIA

from .hooks import Modality, hookimpl


def _image_sequence(codes: Any, spec: Any, layout: str = "inference", **kw: Any) -> Any:
    from apertus_plugins.core.media.image import image_sequence

    return image_sequence(codes, spec, layout=layout, **kw)


def _audio_sequence(codes: Any, spec: Any, layout: str = "default", text_ids: Any = None) -> Any:
    from apertus_plugins.core.media.audio import audio_sequence

    return audio_sequence(codes, spec)


_KINDS = {k.name: k for k in BUILTIN_MEDIA}

#: The released modalities: the core's kinds (:data:`~apertus_plugins.core.vocab.BUILTIN_MEDIA`) with their
#: layouts (the first is the serving layout) and sequence builders.
IMAGE = Modality.of(_KINDS["image"], layouts=("inference", "training"), build_sequence=_image_sequence)
AUDIO = Modality.of(_KINDS["audio"], layouts=("default",), build_sequence=_audio_sequence)


@hookimpl
def apertus_modalities() -> list[Modality]:
    return [IMAGE, AUDIO]
