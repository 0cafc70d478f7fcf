"""What ``apertus eval report`` asks the served model before a run: its name, the context it
serves and the longest audio clip it accepts, so a run that cannot succeed stops at the start
with the server option to change, not hours later with a 400 on the first long prompt.

- ``max_model_len`` is in ``/v1/models`` (vLLM's field);
- the audio limits are in no listing, so they are probed: ``/tokenize`` of a silent clip of the
  needed length. Two limits apply, in this order: vLLM decodes no clip longer than
  ``VLLM_MAX_AUDIO_DECODE_DURATION_S`` (600 s by default, an environment variable of the server),
  then the Apertus processor takes none longer than its ``max_audio_seconds`` (60 s by default,
  ``--mm-processor-kwargs``). The processor checks a clip's length before encoding it, so the
  probe costs no encoder pass; a refusal quotes the limit. The clip is sent at 1 kHz (the server
  resamples any rate to 24 kHz; it is the length that is checked), 16-bit: 2.6 MB for the 22
  minutes of TED-LIUM's longest talk.
"""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass
from typing import Any

from apertus_plugins.infra.client import Client, ClientError, ResponseError

__all__ = ["ServedModel", "ServerCheckError", "audio_probe", "served_model"]


class ServerCheckError(RuntimeError):
    """The server cannot run what was asked; the message names the server option to change."""


@dataclass(frozen=True)
class ServedModel:
    base_url: str  # the /v1 URL
    name: str
    max_model_len: int | None


def served_model(client: Client, base_url: str, model: str | None) -> ServedModel:
    """The served model ``model`` (default: the first the server lists) and its context length."""
    try:
        models = client.models()
    except ClientError as exc:
        raise ServerCheckError(f"no model list at {base_url}/models: {exc}") from exc
    if not models:
        raise ServerCheckError(f"{base_url}/models lists no model")
    entry = models[0] if model is None else next((m for m in models if m.get("id") == model), None)
    if entry is None:
        raise ServerCheckError(f"{base_url} does not serve {model!r}; it serves "
                               f"{', '.join(str(m.get('id')) for m in models)} (--model)")
    length = entry.get("max_model_len")
    return ServedModel(base_url, str(entry["id"]), int(length) if length else None)


def _silent_wav(seconds: float, rate: int = 1000) -> bytes:
    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(round(seconds * rate)), dtype=np.int16), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def audio_probe(client: Client, root: str, model: str, seconds: float) -> str | None:
    """Whether the server accepts a clip of ``seconds``: None when it does, else what to change (the
    server's own limit quoted when its refusal states one)."""
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(_silent_wav(seconds)).decode(),
                                                   "format": "wav"}}
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": [part]}]}
    try:
        client.json("POST", f"{root}/tokenize", body)
    except ResponseError as exc:
        text = str(exc)
        decode = re.search(r"maximum allowed duration of ([\d.]+) ?s", text)
        if decode or "VLLM_MAX_AUDIO_DECODE_DURATION_S" in text:
            said = f"{float(decode.group(1)):g} s" if decode else "shorter clips"
            return (f"clips of up to {seconds:g} s; the server's vLLM decodes {said}: start the server with "
                    f"VLLM_MAX_AUDIO_DECODE_DURATION_S={seconds:g} in its environment, and --mm-processor-kwargs "
                    f"'{{\"max_audio_seconds\": {seconds:g}}}' (the Apertus processor's own limit, 60 s by default)")
        processor = re.search(r"the ([\d.]+) s (?:this server accepts|accepted)", text)
        said = f"{float(processor.group(1)):g} s" if processor else "shorter clips"
        return (f"clips of up to {seconds:g} s; the server accepts {said}: serve with --mm-processor-kwargs "
                f"'{{\"max_audio_seconds\": {seconds:g}}}'" + ("" if processor else f" (it answered: {text[-200:]})"))
    return None
