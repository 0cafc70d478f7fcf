"""What autograd keeps for the backward pass: the activation memory a module or function costs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["saved_tensor_bytes"]


def saved_tensor_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct tensor storages autograd saves for the backward pass while ``fn()`` runs.

    The storages of ``exclude`` (the parameters, which the model holds anyway) are not counted, nor are
    one-element tensors (scalars such as xIELU's alpha, beta and eps are not activations). A storage saved
    twice counts once.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and t.numel() > 1:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
