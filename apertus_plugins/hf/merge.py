"""Put trained text weights back into a released Apertus 1.5 checkpoint.

A text-only post-training run (verl with :class:`~apertus_plugins.hf.modeling.Apertus1p5ForCausalLM`)
saves the decoder and the head only (``model.language_model.*``, ``lm_head.weight``).
:func:`merge_text_weights` writes a new checkpoint directory: the released one with those tensors
replaced by the trained ones (each in the released tensor's dtype), the vision and audio tokenizers,
the configs, the tokenizer and the sharding unchanged. Needs torch and safetensors.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tqdm import tqdm

from apertus_plugins.core.tensor_names import ENCODER_PREFIXES, is_text_tensor

__all__ = ["merge_text_weights", "tensor_files"]

INDEX = "model.safetensors.index.json"


def tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a checkpoint directory (one file, or sharded with an index)."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as fh:
            return dict.fromkeys(fh.keys(), single)
    raise FileNotFoundError(f"{directory}: no model.safetensors or {INDEX}")


def merge_text_weights(trained: Path, released: Path, out: Path) -> Path:
    """Write ``out``: ``released`` with its decoder and head tensors taken from ``trained``.

    ``trained`` must hold every text tensor of ``released`` (same names, same shapes); media tokenizer
    tensors in it are ignored (the released ones are kept); any other tensor is an error. ``out``
    must not exist; it appears only when complete (written beside it, then renamed). ``trained`` and
    ``released`` may be Hub ids (``ORG/NAME[@REVISION]``, :mod:`apertus_plugins.infra.hub`).
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from apertus_plugins.infra.hub import local_path

    trained = local_path(trained, weights=True, what="TRAINED")
    released = local_path(released, weights=True, what="RELEASED")
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: the output directory exists; name a new one")
    src = tensor_files(released)
    new = tensor_files(trained)
    text = {n for n in src if is_text_tensor(n)}
    missing = sorted(text - set(new))
    extra = sorted(n for n in set(new) - set(src) if not n.startswith(ENCODER_PREFIXES))
    if missing or extra:
        raise ValueError(f"{trained}: not the text weights of {released}: "
                         f"missing {missing[:5]}{'...' if len(missing) > 5 else ''} ({len(missing)}), "
                         f"unknown {extra[:5]}{'...' if len(extra) > 5 else ''} ({len(extra)})")

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(released, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    try:
        by_file: dict[Path, list[str]] = {}
        for name, file in src.items():
            by_file.setdefault(file, []).append(name)
        for file, names in tqdm(sorted(by_file.items()), desc="merge", unit="file"):
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(file), framework="pt") as fh:
                metadata = fh.metadata()
                for name in names:
                    tensors[name] = fh.get_tensor(name)
            for name in names:
                if name not in text:
                    continue
                with safe_open(str(new[name]), framework="pt") as fh:
                    value = fh.get_tensor(name)
                if value.shape != tensors[name].shape:
                    raise ValueError(f"{new[name]}: {name} has shape {tuple(value.shape)}, the released "
                                     f"checkpoint {tuple(tensors[name].shape)}")
                tensors[name] = value.to(tensors[name].dtype).contiguous()
            save_file(tensors, str(tmp / file.name), metadata=metadata or {"format": "pt"})
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
