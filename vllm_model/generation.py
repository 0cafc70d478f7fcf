"""Stops every Apertus 1.5 server must have: ``<|assistant_end|>`` and the end of a tool call.

The released checkpoint lists ``<|assistant_end|>`` and ``<|tools_suffix|>`` in
``generation_config.json`` (the tokenizer's ``eos_token`` is ``</s>``). A checkpoint whose
generation config lacks either (or that has none) lets the model run past a tool call and
fabricate its result (report 7.4). vLLM reads its stop ids from the generation config, so when
one is missing this hook writes a completed copy next to the user's cache and points vLLM at it;
every other field of the checkpoint's generation config is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from apertus_plugins.core.release import STOP_TOKENS
from apertus_plugins.core.vocab import VocabError, VocabSpec, default_spec
from apertus_plugins.infra.files import write_text_atomic

from .logs import get_logger

logger = get_logger(__name__)  # under vLLM's `vllm` logger: shown by `vllm serve`

__all__ = ["required_stop_ids", "completed_generation_config", "complete_stops"]


def required_stop_ids(tokenizer_dir: str | os.PathLike | None) -> list[int]:
    """``[<|assistant_end|>, <|tools_suffix|>]`` of the tokenizer directory (released ids when unreadable)."""
    spec = default_spec()
    if tokenizer_dir is not None and Path(tokenizer_dir, "tokenizer.json").is_file():
        try:
            spec = VocabSpec.from_tokenizer_dir(tokenizer_dir)
        except VocabError as exc:
            logger.warning("apertus: %s; using the released stop ids", exc)
    return [spec.id(name) for name in STOP_TOKENS]


def completed_generation_config(current: dict[str, Any], stop_ids: list[int]) -> dict[str, Any] | None:
    """``current`` with ``stop_ids`` added to ``eos_token_id``, or ``None`` when it already has them."""
    eos = current.get("eos_token_id")
    have = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    missing = [i for i in stop_ids if i not in have]
    if not missing:
        return None
    out = dict(current)
    out["eos_token_id"] = have + missing
    return out


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "apertus-plugins" / "generation-config"


def _write_config(data: dict[str, Any]) -> Path:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    folder = _cache_dir() / hashlib.sha256(text.encode()).hexdigest()[:16]
    target = folder / "generation_config.json"
    if not target.is_file():
        write_text_atomic(target, text)
    return folder


def complete_stops(model_config: Any) -> None:
    """Point vLLM at a completed generation config when the checkpoint's lacks the stops."""
    if model_config.generation_config == "vllm":
        return  # the user asked for vLLM's neutral defaults; stops are then theirs to give
    current = model_config.try_get_generation_config()
    stop_ids = required_stop_ids(model_config.tokenizer)
    completed = completed_generation_config(current, stop_ids)
    if completed is None:
        return
    folder = _write_config(completed)
    logger.warning(
        "apertus: the generation config of %s lacks the stop ids %s (<|assistant_end|>, <|tools_suffix|>); "
        "serving with eos_token_id %s from %s", model_config.model, stop_ids, completed["eos_token_id"], folder)
    model_config.generation_config = str(folder)
