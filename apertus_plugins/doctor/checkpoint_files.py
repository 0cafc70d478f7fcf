"""Read-only access to the files of a checkpoint directory, each read once.

Nothing here needs torch: tensor shapes come from the safetensors headers (an 8-byte length and
a JSON header before the data), so the doctor runs in the core environment.
"""

from __future__ import annotations

import hashlib
import json
import struct
from functools import cached_property
from pathlib import Path
from typing import Any

from apertus_plugins.infra.files import read_json

__all__ = ["DoctorError", "CheckpointFiles", "TOKENIZER_FILES", "token_literal"]

#: The files that make up a tokenizer (compared across stages by ``--compare``).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model")
_TEMPLATE_DIR = "additional_chat_templates"


class DoctorError(ValueError):
    """An input the doctor cannot work with (not a directory, an unreadable file, an unreachable server)."""


def token_literal(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` stores it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class CheckpointFiles:
    """The configs, tokenizer, chat templates and tensor shapes of a checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        from apertus_plugins.infra.hub import HubError, local_path

        try:  # a Hub id (ORG/NAME[@REVISION]) is read from its snapshot in the Hugging Face cache
            self.path = local_path(path, weights=True, what="checkpoint")
        except HubError as exc:
            raise DoctorError(str(exc)) from exc
        if not self.path.is_dir():
            raise DoctorError(f"{self.path}: not a directory (a checkpoint or tokenizer directory is required)")
        self._json: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"CheckpointFiles({str(self.path)!r})"

    # ------------------------------------------------------------------ JSON files
    def json(self, name: str) -> Any:
        """The parsed JSON file ``name`` of the directory, ``None`` when absent."""
        if name not in self._json:
            f = self.path / name
            if not f.is_file():
                self._json[name] = None
            else:
                self._json[name] = read_json(f, DoctorError)
        return self._json[name]

    def require(self, name: str) -> Any:
        """Like :meth:`json`, but a missing file raises :class:`DoctorError` naming it."""
        data = self.json(name)
        if data is None:
            raise DoctorError(f"{self.path}: no {name}")
        return data

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        return self.json("tokenizer_config.json") or {}

    @property
    def config(self) -> dict[str, Any]:
        """``config.json`` (raises when absent)."""
        return self.require("config.json")

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config: ``text_config`` of a multimodal config, else the config itself."""
        cfg = self.config
        return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg

    def token(self, key: str) -> str | None:
        """A special token literal (``"bos_token"``, ``"eos_token"``...) as transformers would read it."""
        value = token_literal(self.tokenizer_config.get(key))
        if value is None:
            value = token_literal((self.json("special_tokens_map.json") or {}).get(key))
        return value

    def special_tokens(self) -> dict[str, str]:
        """The special tokens a chat template receives (those that are set)."""
        out = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = self.token(key)
            if value is not None:
                out[key] = value
        return out

    # ------------------------------------------------------------------ tokenizer
    @cached_property
    def tokenizer(self) -> Any:
        """The fast tokenizer (``tokenizers.Tokenizer``) of ``tokenizer.json``."""
        from tokenizers import Tokenizer

        f = self.path / "tokenizer.json"
        if not f.is_file():
            raise DoctorError(f"{self.path}: no tokenizer.json (a Hugging Face fast tokenizer is required)")
        try:
            return Tokenizer.from_file(str(f))
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise DoctorError(f"{f}: cannot load the tokenizer ({exc})") from exc

    # ------------------------------------------------------------------ chat templates
    @cached_property
    def chat_templates(self) -> dict[str, str]:
        """Name -> template source, as transformers 5 finds them.

        ``chat_template.jinja`` and ``additional_chat_templates/NAME.jinja`` first, then
        ``chat_template.json``, then ``tokenizer_config.json``'s ``chat_template`` (a string, or a
        list of ``{"name", "template"}``). The inference template is ``"default"``.
        """
        out: dict[str, str] = {}

        def add(value: Any) -> None:
            if isinstance(value, str):
                out.setdefault("default", value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, dict) and isinstance(item.get("template"), str):
                        out.setdefault(str(item.get("name", "default")), item["template"])

        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            out["default"] = jinja.read_text(encoding="utf-8")
        extra = self.path / _TEMPLATE_DIR
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                out.setdefault(f.stem, f.read_text(encoding="utf-8"))
        add((self.json("chat_template.json") or {}).get("chat_template"))
        add(self.tokenizer_config.get("chat_template"))
        return out

    # ------------------------------------------------------------------ tensors
    @cached_property
    def tensor_shapes(self) -> dict[str, list[int]]:
        """Tensor name -> shape, read from the safetensors headers (sharded or not)."""
        index = self.json("model.safetensors.index.json")
        if index is not None:
            files = sorted(set((index.get("weight_map") or {}).values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise DoctorError(f"{self.path}: no safetensors weights")
        shapes: dict[str, list[int]] = {}
        for name in files:
            for tensor, info in _safetensors_header(self.path / name).items():
                if tensor != "__metadata__":
                    shapes[tensor] = [int(d) for d in info["shape"]]
        return shapes

    def tensor_rows(self, name: str) -> int | None:
        """The first dimension of tensor ``name``, ``None`` when the checkpoint has no such tensor."""
        shape = self.tensor_shapes.get(name)
        return shape[0] if shape else None

    # ------------------------------------------------------------------ hashing
    def sha256(self, name: str) -> str | None:
        f = self.path / name
        if not f.is_file():
            return None
        return hashlib.sha256(f.read_bytes()).hexdigest()


def _safetensors_header(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DoctorError(f"{path}: missing (named by model.safetensors.index.json)")
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise DoctorError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise DoctorError(f"{path}: not a safetensors file (header length {n})")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DoctorError(f"{path}: unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise DoctorError(f"{path}: unreadable safetensors header")
    return header
