"""numpy in, numpy out; torch tensors accepted without importing torch unless a caller passes one."""

from __future__ import annotations

from typing import Any

import numpy as np


def to_numpy(x: Any) -> tuple[np.ndarray, Any]:
    """Array view of ``x``; the second value is the torch tensor it came from (or None)."""
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy(), x
    return np.asarray(x), None


def like(out: np.ndarray, src: Any) -> Any:
    """``out`` as the same kind of object as ``src`` (a torch tensor on its device, or numpy)."""
    if src is None:
        return out
    import torch  # only reached when the caller passed a torch tensor

    return torch.from_numpy(np.ascontiguousarray(out)).to(src.device)
