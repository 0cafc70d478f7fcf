"""Apertus 1.5 evaluation for upstream lm-eval (0.4.x) and lmms-eval (0.7.x).

- ``eval_tasks/lm_eval/``: lm-eval task YAMLs, a ``utils.py`` beside each; pass the folder as
  ``--include_path "$(apertus eval-path lm_eval)"`` and run them against a served model with
  ``--model local-chat-completions --apply_chat_template``.
- ``eval_tasks/lmms_eval/``: lmms-eval task YAMLs (``--include_path "$(apertus eval-path lmms_eval)"``);
  the model wrapper :mod:`eval_tasks.lmms_model` is registered as ``apertus`` through the
  ``lmms_eval.models`` entry point.
- :mod:`eval_tasks.data`: where each task finds its local data, with clear errors.

The protocol facts (thinking stripping, answer extraction, the degeneration metric, call
scoring) live in :mod:`apertus_plugins.evaluation`; this package only plugs them in.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["SUPPORTED", "require"]

#: Supported upstream ranges: distribution -> (lowest version, first unsupported version).
SUPPORTED: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "lm_eval": ((0, 4), (0, 5)),
    "lmms_eval": ((0, 7), (0, 8)),
}
_DIST = {"lm_eval": "lm-eval", "lmms_eval": "lmms-eval"}


def require(harness: str) -> str:
    """Check that ``harness`` (``lm_eval`` or ``lmms_eval``) is installed in a supported version.

    Returns the installed version; raises ImportError naming the supported range otherwise.
    """
    lo, hi = SUPPORTED[harness]
    rng = f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    try:
        version = metadata.version(_DIST[harness])
    except metadata.PackageNotFoundError as exc:
        raise ImportError(f"the Apertus {harness} tasks need {_DIST[harness]} {rng}, which is not installed") from exc
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    have = tuple(parts + [0] * (2 - len(parts)))
    if not lo <= have < hi:
        raise ImportError(f"the Apertus {harness} tasks support {_DIST[harness]} {rng}; found {version}")
    return version
