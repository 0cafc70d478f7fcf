"""The precision contract of the media encoders (SPEC.md 2.1).

A code is an argmax (images) or a nearest neighbour (audio) over a large codebook, so the float
arithmetic of the encoder decides which code wins a near tie. The encoders therefore carry their
precision as an explicit setting and apply it themselves around every forward pass, whatever the
global torch flags say:

- ``"float32"`` (the default): IEEE float32 matmuls and convolutions on every backend (cuBLAS,
  cuDNN, oneDNN). Bit-compatible with the released ``transformers`` port on CPU.
- ``"tf32"``: TensorFloat-32 matmuls and convolutions on a CUDA GPU (what the public offline
  pipeline pins). Refused on CPU, where it does not exist.

Half precision (a float16/bfloat16 module, input or checkpoint tensor) is refused: bf16 flips
7-10% of the image codes.

The flags are process-wide in torch: while an encoder runs, other threads' matmuls see its
setting too. Encoder calls hold a process-wide lock, so concurrent encodes never interleave their
set and restore.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Literal

import torch

__all__ = ["Precision", "PRECISIONS", "PrecisionError", "check_precision", "precision_scope", "check_float32"]

Precision = Literal["float32", "tf32"]
#: The precisions an encoder accepts.
PRECISIONS: tuple[str, ...] = ("float32", "tf32")

_HALF = (torch.float16, torch.bfloat16)
_LOCK = threading.RLock()


class PrecisionError(ValueError):
    """A precision setting, device or dtype that breaks the exactness contract."""


def check_precision(precision: str, device: torch.device | str | None = None) -> str:
    """Validate ``precision`` (and, given a device, that TF32 runs on CUDA); return it."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"unknown precision {precision!r}; the encoders run in {' or '.join(PRECISIONS)} "
                             "(half precision is refused: it flips codes)")
    if device is not None and precision == "tf32" and torch.device(device).type != "cuda":
        raise PrecisionError(f"precision 'tf32' needs a CUDA device, the encoder is on {torch.device(device)}; "
                             "use precision='float32' on CPU")
    return precision


def check_float32(tensor: torch.Tensor, what: str) -> None:
    """Raise :class:`PrecisionError` unless ``tensor`` is float32 (naming ``what`` and its dtype)."""
    if tensor.dtype in _HALF:
        raise PrecisionError(f"{what} is {tensor.dtype}: half precision is refused (bf16 flips 7-10% of the "
                             "codes); the encoders run on float32 weights and inputs")
    if tensor.dtype != torch.float32:
        raise PrecisionError(f"{what} is {tensor.dtype}, expected torch.float32")


# (backend object, attribute name) pairs of the new fp32_precision API (torch >= 2.9)
def _new_api_flags() -> list[tuple[object, str]] | None:
    b = torch.backends
    try:
        objs = [b.cuda.matmul, b.cudnn.conv, b.cudnn.rnn, b.mkldnn.matmul, b.mkldnn.conv, b.mkldnn.rnn]
        if not all(hasattr(o, "fp32_precision") for o in objs):
            return None
    except AttributeError:
        return None
    return [(o, "fp32_precision") for o in objs]


@contextlib.contextmanager
def precision_scope(precision: str) -> Iterator[None]:
    """Run the enclosed code with ``precision``'s float32 arithmetic, then restore every flag.

    Sets cuBLAS matmuls, cuDNN convolutions and RNNs (and, for ``"float32"``, oneDNN on CPU) to
    IEEE float32 or to TF32; the previous values are restored on exit, also after an error.
    """
    check_precision(precision)
    with _LOCK:
        yield from _scope(precision)


def _scope(precision: str) -> Iterator[None]:
    flags = _new_api_flags()
    if flags is not None:
        saved = [getattr(o, a) for o, a in flags]
        try:
            for o, a in flags:
                is_cpu = o in (torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv, torch.backends.mkldnn.rnn)
                setattr(o, a, "ieee" if precision == "float32" or is_cpu else "tf32")
            yield
        finally:
            for (o, a), v in zip(flags, saved, strict=True):
                setattr(o, a, v)
        return
    # older torch: the legacy switches
    saved_legacy = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                    torch.get_float32_matmul_precision())
    tf32 = precision == "tf32"
    try:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_legacy[:2]
        torch.set_float32_matmul_precision(saved_legacy[2])
