"""The lmms-eval model ``apertus``: Apertus 1.5 served by vLLM's OpenAI-compatible server.

    lmms-eval --model apertus --model_args base_url=http://127.0.0.1:8000/v1,enable_thinking=false \\
        --tasks apertus_chartqa --include_path "$(apertus eval-path lmms_eval)"

A chat model of lmms-eval 0.7 (``is_simple = False``), registered through the ``lmms_eval.models``
entry point (:mod:`eval_tasks.lmms_registry`): each request carries the task's messages
(``doc_to_messages``: images and audio clips before the task's text, as lmms-eval's chat tasks
build them) and becomes one chat completion through the package's HTTP client
(:mod:`apertus_plugins.infra.client`: its retry policy, the API key). Images go as PNG data URLs, audio
clips resampled to 24 kHz mono as WAV; the thinking flag through ``chat_template_kwargs``; special
tokens kept in the output (``skip_special_tokens=False``) so the thinking span can be stripped
(both surface forms, :func:`apertus_plugins.posttrain.evaluation.strip_thinking`) before the task scores the
answer; the task's stop strings plus the Apertus turn, sequence and tool-call stops; the task's
output cap (``max_new_tokens``) unless ``max_new_tokens`` is given here; with thinking on, the
protocol's thinking budget (32,768 tokens at temperature 0.6 and top-p 0.95, SPEC.md 7) instead of the
task's cap (thinking is on when ``enable_thinking`` is given here or the task's ``generation_kwargs``
set ``chat_template_kwargs.enable_thinking``, as the derived ``*_think`` tasks do); and never more
than the served context leaves after the prompt (``max_model_len`` in
``/v1/models`` minus the prompt's ids from the server's ``/tokenize``: vLLM answers 400 to a request
whose prompt and cap exceed its context). vLLM sampling parameters a task's
``generation_kwargs`` set (:data:`PASSTHROUGH`, e.g. ``logit_bias``, ``seed``) go into the request
as they are.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from apertus_plugins.posttrain.evaluation import (
    AUDIO_SAMPLE_RATE,
    DEFAULT_DECODING,
    THINKING_DECODING,
    stop_strings,
    strip_thinking,
)

from . import require

require("lmms_eval")

from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.api.model import lmms  # noqa: E402

from apertus_plugins.infra.client import Client, ClientError, RetryPolicy, Unreachable  # noqa: E402

__all__ = ["PASSTHROUGH", "Apertus", "ServerUnreachable", "audio_part", "image_part", "openai_messages"]
#: Sampling parameters of vLLM's OpenAI-compatible server that a task's ``generation_kwargs`` may
#: set; they go into the request unchanged (other keys, such as ``do_sample``, are harness settings).
PASSTHROUGH = ("seed", "top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "logit_bias")


class ServerUnreachable(ConnectionError):
    """The served model did not answer; the message names the URL and the model argument."""


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def image_part(image: Any) -> dict[str, Any]:
    """An OpenAI ``image_url`` part holding ``image`` (PIL image or path) as a PNG data URL.

    A file is opened by the core (its header checked against the media limits before decoding,
    EXIF-transposed); an image above the limits is an ``ImageError`` naming it.
    """
    from apertus_plugins.core.media import image as media_image
    from apertus_plugins.core.media.limits import check_image_size

    if isinstance(image, (str, os.PathLike, bytes)):
        img = media_image.decode_image(media_image.open_image(image), name="image" if isinstance(image, bytes) else str(image))
    else:
        img = image
        check_image_size(img.height, img.width)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def _waveform(clip: Any) -> tuple[Any, int]:
    import numpy as np

    from apertus_plugins.core.media.audio import load_audio

    if isinstance(clip, dict) and clip.get("array") is not None:
        wave = np.asarray(clip["array"], dtype=np.float32)
        if wave.ndim == 2 and wave.shape[0] > wave.shape[1]:  # [samples, channels] -> [channels, samples]
            wave = wave.T
        return wave, int(clip["sampling_rate"])
    if isinstance(clip, dict):  # datasets' Audio(decode=False): {"bytes", "path"}
        source = clip.get("bytes") or clip.get("path")
        if source is None:
            raise ValueError("audio clip without 'array', 'bytes' or 'path'")
        return load_audio(source)
    if isinstance(clip, (str, os.PathLike, bytes)):
        return load_audio(clip)
    raise TypeError(f"unsupported audio clip {type(clip).__name__}")


def audio_part(clip: Any) -> dict[str, Any]:
    """An OpenAI ``input_audio`` part: the clip downmixed and resampled to 24 kHz, as float WAV."""
    import soundfile as sf

    from apertus_plugins.core.media.audio import preprocess_audio

    wave, rate = _waveform(clip)
    wave = preprocess_audio(wave, rate)
    buf = io.BytesIO()
    sf.write(buf, wave, AUDIO_SAMPLE_RATE, format="WAV", subtype="FLOAT")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}


def openai_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages from lmms-eval's (a task's ``doc_to_messages`` or a ``ChatMessages``).

    Text parts stay text, image parts become :func:`image_part`, audio parts :func:`audio_part`;
    the order of the parts is kept (lmms-eval's tasks put the media before the text).
    """
    from lmms_eval.protocol import ChatMessages

    chat = messages if isinstance(messages, ChatMessages) else ChatMessages(messages=list(messages))
    out = []
    for message in chat.messages:
        parts = []
        for part in message.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
            elif part.type == "image":
                parts.append(image_part(part.url))
            elif part.type == "audio":
                parts.append(audio_part(part.url))
            else:
                raise TypeError(f"the apertus model takes images and audio; got a {part.type} part "
                                f"{str(part.url)[:80]!r}")
        out.append({"role": message.role, "content": parts})
    return out


class Apertus(lmms):
    """Apertus 1.5 behind an OpenAI-compatible vLLM server (see the module docstring).

    Args (``--model_args``):
        base_url: the server's ``/v1`` URL.
        model: the served model name (default: the first one the server lists).
        enable_thinking: the chat template's thinking flag (off by default, as the protocol).
        max_new_tokens: an output cap for every request, replacing the task's.
        temperature, top_p: sampling (default: greedy; with thinking, the protocol's 0.6 and 0.95).
        strip_thinking: give the task the answer without the thinking span (default true).
        num_concurrent: requests in flight.
        timeout: seconds per try; max_retries: tries per request (the client's retry policy).
        api_key: the server's API key (default ``$OPENAI_API_KEY`` when set).
    """

    is_simple = False

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", model: str | None = None,
                 enable_thinking: Any = False, max_new_tokens: Any = None, temperature: Any = None,
                 top_p: Any = None, strip_thinking: Any = True, num_concurrent: Any = 1, timeout: Any = 600,
                 max_retries: Any = 3, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.base_url = str(base_url).rstrip("/")
        self.enable_thinking = _as_bool(enable_thinking)
        self.max_new_tokens = int(max_new_tokens) if max_new_tokens not in (None, "", "None") else None
        self.temperature = float(temperature) if temperature not in (None, "", "None") else None
        self.top_p = float(top_p) if top_p not in (None, "", "None") else None
        self.strip_thinking = _as_bool(strip_thinking)
        self.num_concurrent = max(1, int(num_concurrent))
        self.timeout = float(timeout)
        self.max_retries = max(1, int(max_retries))
        self.client = Client(self.base_url, api_key=api_key, timeout=self.timeout,
                             retry=RetryPolicy(attempts=self.max_retries))
        #: the served context length; looked up in ``/v1/models`` before the first request
        self.max_model_len: int | None = None
        self._served: list[dict[str, Any]] | None = None
        self.model = model or str(self._models()[0]["id"])

    # ------------------------------------------------------------------ server
    def _models(self) -> list[dict[str, Any]]:
        """The server's model list (``/v1/models``), fetched once."""
        if self._served is not None:
            return self._served
        url = f"{self.base_url}/models"
        try:
            self._served = self.client.models()
        except Unreachable as exc:
            raise ServerUnreachable(f"apertus model: no server answers at {url} (model_args base_url="
                                    f"{self.base_url}): {exc}") from exc
        except ClientError as exc:
            raise ServerUnreachable(f"apertus model: {url} gave no model list: {exc}") from exc
        return self._served

    def _context_length(self) -> int | None:
        """The served model's ``max_model_len`` (None when the server does not say)."""
        if self.max_model_len is None:
            entry = next((m for m in self._models() if m.get("id") == self.model), None)
            if entry is None:
                names = ", ".join(str(m.get("id")) for m in self._models())
                raise ServerUnreachable(f"apertus model: {self.base_url} does not serve model {self.model!r} "
                                        f"(model_args model=); it serves {names}")
            if entry.get("max_model_len"):
                self.max_model_len = int(entry["max_model_len"])
        return self.max_model_len

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}/chat/completions"
        try:
            body = self.client.json("POST", "/chat/completions", payload)
        except ClientError as exc:
            raise ServerUnreachable(f"apertus model: request to {url} (model {self.model}) failed after "
                                    f"{self.max_retries} attempt(s) at most: {exc}") from exc
        if not isinstance(body, dict) or not body.get("choices"):
            raise ServerUnreachable(f"apertus model: {url} (model {self.model}) answered without choices: "
                                    f"{str(body)[:300]}")
        return body

    # ------------------------------------------------------------------ requests
    def payload(self, messages: Sequence[Any], gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The chat-completion request for one task request: its messages (lmms-eval's) and generation settings."""
        gen = dict(gen_kwargs or {})
        until = gen.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        stops = list(dict.fromkeys([*until, *stop_strings()]))
        # thinking: the model argument, or the task's chat template flag (the derived *_think tasks)
        thinking = self.enable_thinking or bool((gen.get("chat_template_kwargs") or {}).get("enable_thinking"))
        if self.max_new_tokens:
            cap = self.max_new_tokens
        elif thinking:  # the task's cap counts no thinking: the protocol's thinking budget (SPEC.md 7)
            cap = int(THINKING_DECODING["max_new_tokens"])
        else:
            cap = int(gen.get("max_new_tokens") or gen.get("max_gen_toks") or DEFAULT_DECODING["max_new_tokens"])
        if self.max_model_len:
            cap = min(cap, self.max_model_len)
        # sampling: the model argument, else the protocol's thinking setting, else the task's (greedy by default)
        if thinking:
            temperature, top_p = THINKING_DECODING["temperature"], THINKING_DECODING["top_p"]
        else:
            temperature, top_p = float(gen.get("temperature") or 0.0), gen.get("top_p")
        temperature = self.temperature if self.temperature is not None else temperature
        top_p = self.top_p if self.top_p is not None else top_p
        body: dict[str, Any] = {
            "model": self.model,
            "messages": openai_messages(messages),
            "max_tokens": cap,
            "temperature": temperature,
            "stop": stops,
            "skip_special_tokens": False,
            "chat_template_kwargs": {"enable_thinking": thinking},
        }
        if top_p is not None and float(top_p) != 1.0:
            body["top_p"] = float(top_p)
        body.update({k: gen[k] for k in PASSTHROUGH if gen.get(k) is not None})
        return body

    def _answer(self, body: dict[str, Any]) -> str:
        message = body["choices"][0].get("message") or {}
        text = message.get("content") or ""
        return strip_thinking(text) if self.strip_thinking else text

    def prompt_length(self, body: dict[str, Any]) -> int:
        """The ids the server makes of a request's prompt (its ``/tokenize``, media sequences included)."""
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        payload = {k: body[k] for k in ("model", "messages", "chat_template_kwargs") if k in body}
        try:
            out = self.client.json("POST", f"{root}/tokenize", payload)
        except ClientError as exc:
            raise ServerUnreachable(f"apertus model: {root}/tokenize (model {self.model}) failed: {exc}") from exc
        return int(out["count"])

    def fit_to_context(self, body: dict[str, Any], where: str) -> dict[str, Any]:
        """The output cap lowered so prompt and output fit the served context (vLLM answers 400 or
        shortens the cap silently otherwise, depending on its version)."""
        if not self.max_model_len:
            return body
        room = self.max_model_len - self.prompt_length(body)
        if room < 1:
            raise ValueError(f"apertus model: {where}: the prompt fills the served context of {self.max_model_len} "
                             "tokens; serve a longer --max-model-len")
        return {**body, "max_tokens": min(int(body["max_tokens"]), room)}

    def _one(self, request: Instance) -> str:
        _context, doc_to_messages, gen_kwargs, doc_id, task, split = request.args
        messages = doc_to_messages(self.task_dict[task][split][doc_id])
        self._context_length()
        body = self.fit_to_context(self.payload(messages, gen_kwargs), f"task {task} document {doc_id}")
        return self._answer(self._post(body))

    def generate_until(self, requests: list[Instance]) -> list[str]:
        from tqdm import tqdm

        with ThreadPoolExecutor(max_workers=self.num_concurrent) as pool:
            return list(tqdm(pool.map(self._one, requests), total=len(requests), desc="apertus",
                             disable=self.rank != 0))

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("the apertus lmms-eval model runs generation tasks only (output_type generate_until)")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("the apertus lmms-eval model does not run multi-round tasks")
