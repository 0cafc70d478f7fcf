"""The test fixtures of apertus-plugins as a pytest plugin.

Installed with the package and loaded by pytest through the ``pytest11`` entry point (the way
``pytester`` and other pytest plugins arrive), so a suite of this repository and a third-party plugin
author's package get the same fixtures without copying them::

    def test_my_modality(apertus_tiny_checkpoint, apertus_vllm_server):
        server = apertus_vllm_server(apertus_tiny_checkpoint, args=["--dtype", "float32"])
        ...

Nothing here imports torch, vLLM or a framework when pytest starts; each fixture imports what it
needs when a test asks for it. Disable the plugin with ``-p no:apertus``.

Fixtures (``session`` scope unless noted):

* ``apertus_small_spec``: the scaled-down vocabulary (:meth:`VocabSpec.scaled`).
* ``apertus_tokenizer_dir``: a test tokenizer over that vocabulary (no templates).
* ``apertus_full_tokenizer_dir``: a test tokenizer over the released vocabulary (no templates).
* ``apertus_checkpoint_factory``: ``make(**kwargs) -> Path``, a random checkpoint in the released layout
  (:func:`~apertus_plugins.testing.checkpoint.write_checkpoint` keywords), written once per distinct
  keywords and session.
* ``apertus_tiny_checkpoint``: ``make(size="tiny", init="varied")``: every tensor shapes the output.
* ``apertus_vllm_server``: ``start(model, args=..., env=..., python=..., name=...) -> VLLMServer``, a real
  vLLM server on loopback (the ``vllm`` suite's interpreter when ``APERTUS_PYTHON_VLLM`` names one), with the
  CPU flags and the model in the engine core's process (``ONE_PROCESS_ARGS``, 10 s less per start), stopped
  with its whole process group when the session ends.
* ``apertus_free_port`` (function scope): a TCP port free on loopback.
* ``apertus_offline_hub`` (function scope): an empty Hugging Face Hub cache read offline (``HF_HUB_CACHE``,
  ``HF_HUB_OFFLINE=1`` set for the test); the value is those variables, for a subprocess's environment.
* ``apertus_process_group``: a one-rank ``gloo`` process group of ``torch.distributed``, destroyed at the end.
* ``apertus_image_part``, ``apertus_audio_part``: OpenAI chat content parts carrying the bundled demo
  image and clip.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: the bundled demo media (``apertus_plugins/assets``)
ASSETS = Path(__file__).resolve().parent.parent / "assets"


@pytest.fixture(scope="session")
def apertus_small_spec() -> Any:
    """The scaled-down vocabulary: the released structure with small blocks."""
    from apertus_plugins.core.vocab import VocabSpec

    return VocabSpec.scaled()


@pytest.fixture(scope="session")
def apertus_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, apertus_small_spec: Any) -> Path:
    """A test tokenizer directory over :func:`apertus_small_spec` (no chat templates written)."""
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    return build_test_tokenizer(tmp_path_factory.mktemp("apertus-tok-small"), apertus_small_spec, with_templates=False)


@pytest.fixture(scope="session")
def apertus_full_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test tokenizer directory over the released vocabulary (266,440 entries; no chat templates written)."""
    from apertus_plugins.core.vocab import default_spec
    from apertus_plugins.testing.tokenizer_builder import build_test_tokenizer

    return build_test_tokenizer(tmp_path_factory.mktemp("apertus-tok-full"), default_spec(), with_templates=False)


@pytest.fixture(scope="session")
def apertus_checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(**kwargs)``: a random checkpoint in the released layout, one per distinct keywords and session."""
    made: dict[str, Path] = {}

    def make(**kwargs: Any) -> Path:
        from apertus_plugins.testing.checkpoint import write_checkpoint

        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key not in made:
            made[key] = write_checkpoint(tmp_path_factory.mktemp("apertus-ckpt") / "apertus-tiny", **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def apertus_tiny_checkpoint(apertus_checkpoint_factory: Callable[..., Path]) -> Path:
    """The tiny random checkpoint (released tensor names and id layout, media tokenizers, chat template)."""
    return apertus_checkpoint_factory(size="tiny", init="varied")


@pytest.fixture
def apertus_free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now."""
    from apertus_plugins.testing.serve import free_port

    return free_port()


@pytest.fixture
def apertus_offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An empty Hub cache (``HF_HUB_CACHE``) that huggingface_hub reads offline (``HF_HUB_OFFLINE=1``), both set
    in this process for the test; returns the two variables, to hand a subprocess."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture(scope="session")
def apertus_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """``start(model, args=(), env=None, python=None, name="server", startup_timeout=900)``: a started
    :class:`~apertus_plugins.testing.serve.VLLMServer` (CPU flags and ``ONE_PROCESS_ARGS`` first, then ``args``); its log goes to a
    session folder. Every server started here is stopped, process group and all, when the session ends."""
    from apertus_plugins.testing.serve import CPU_ARGS, ONE_PROCESS_ARGS, VLLMServer

    started: list[Any] = []

    def start(model: str | Path, args: list[str] | tuple[str, ...] = (), *, env: dict[str, str] | None = None,
              python: str | None = None, name: str = "server", startup_timeout: float = 900) -> Any:
        log = tmp_path_factory.mktemp("apertus-vllm-logs") / f"{name}.log"
        server = VLLMServer(model, args=[*CPU_ARGS, *ONE_PROCESS_ARGS, *args], python=python or os.environ.get("APERTUS_PYTHON_VLLM"),
                            env=env, log_path=log, startup_timeout=startup_timeout)
        started.append(server)
        return server.start()

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture(scope="session")
def apertus_process_group() -> Iterator[None]:
    """A one-rank ``gloo`` group of ``torch.distributed`` on a free loopback port (reused if one exists)."""
    import torch.distributed as dist

    from apertus_plugins.testing.serve import free_port

    owned = not dist.is_initialized()
    if owned:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def _data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.fixture(scope="session")
def apertus_image_part() -> dict[str, Any]:
    """An ``image_url`` content part with the bundled demo image as a data URL."""
    return {"type": "image_url", "image_url": {"url": _data_url(ASSETS / "demo.png", "image/png")}}


@pytest.fixture(scope="session")
def apertus_audio_part() -> dict[str, Any]:
    """An ``input_audio`` content part with the bundled demo clip (WAV, base64)."""
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode((ASSETS / "demo.wav").read_bytes()).decode(), "format": "wav"}}
