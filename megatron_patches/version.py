"""Which megatron-core (and Megatron-LM) versions the adapter supports, checked before any use."""

from __future__ import annotations

import importlib

from packaging.version import Version

from apertus_plugins.infra.versions import SUPPORTED as VERSIONS
from apertus_plugins.infra.versions import UnsupportedVersionError, require

__all__ = ["SUPPORTED", "SUPPORTED_RANGE", "MegatronVersionError", "megatron_core_version", "check_version",
           "require_supported"]

#: (major, minor) -> the form of Megatron-LM's training entry that goes with it.
SUPPORTED = {
    (0, 16): "pretrain(train_valid_test_dataset_provider, model_provider, ..., extra_args_provider=...)",
    (0, 19): "parse_and_validate_args(extra_args_provider=...) + pretrain(config_container, ...)",
}
SUPPORTED_RANGE = "megatron-core " + VERSIONS["megatron-core"].range()


class MegatronVersionError(UnsupportedVersionError):
    """megatron-core (or Megatron-LM) is missing or of a version the adapter does not support."""


def megatron_core_version() -> str:
    """The version of the ``megatron.core`` that ``import megatron`` finds (pip or a Megatron-LM checkout)."""
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError as exc:
        raise MegatronVersionError(
            f"megatron-core is not importable ({exc}); install it (pip install 'apertus-plugins[megatron]') "
            f"or put a Megatron-LM checkout on PYTHONPATH. Supported: {SUPPORTED_RANGE}") from exc
    return str(info.__version__)


def check_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` if supported, else :class:`MegatronVersionError` naming the range."""
    try:
        require("megatron-core", version)
    except UnsupportedVersionError as exc:
        raise MegatronVersionError(str(exc)) from None
    release = Version(version).release
    return release[0], release[1]


_CHECKED: list[tuple[int, int]] = []


def require_supported() -> tuple[int, int]:
    """Check the installed megatron-core once per process; returns its ``(major, minor)``."""
    if not _CHECKED:
        _CHECKED.append(check_version(megatron_core_version()))
    return _CHECKED[0]
