"""Apertus 1.5 evaluation for upstream lm-eval (0.4.x) and lmms-eval (0.7.x).

- ``eval_tasks/lm_eval/``: lm-eval task YAMLs, a ``utils.py`` beside each; pass the folder as
  ``--include_path "$(apertus eval-path lm_eval)"`` and run them against a served model with
  ``--model local-chat-completions --apply_chat_template``.
- ``eval_tasks/lmms_eval/``: lmms-eval task YAMLs (``--include_path "$(apertus eval-path lmms_eval)"``);
  the model wrapper :mod:`eval_tasks.lmms_model` is registered as ``apertus`` through the
  ``lmms_eval.models`` entry point.
- :mod:`eval_tasks.data`: where each task finds its local data, with clear errors.

The protocol facts (thinking stripping, answer extraction, the degeneration metric, call
scoring) live in :mod:`apertus_plugins.posttrain.evaluation`; this package only plugs them in.
"""

from __future__ import annotations

from importlib import metadata

from apertus_plugins.infra.versions import SUPPORTED as VERSIONS
from apertus_plugins.infra.versions import UnsupportedVersionError
from apertus_plugins.infra.versions import require as check

__all__ = ["SUPPORTED", "require"]

#: The harnesses and their distributions; the supported ranges are :data:`apertus_plugins.infra.versions.SUPPORTED`'s.
SUPPORTED: dict[str, str] = {"lm_eval": VERSIONS["lm-eval"].specifier, "lmms_eval": VERSIONS["lmms-eval"].specifier}
_DIST = {"lm_eval": "lm-eval", "lmms_eval": "lmms-eval"}


def require(harness: str) -> str:
    """Check that ``harness`` (``lm_eval`` or ``lmms_eval``) is installed in a supported version.

    Returns the installed version; raises ImportError naming the supported range otherwise.
    """
    try:
        version: str | None = metadata.version(_DIST[harness])
    except metadata.PackageNotFoundError:
        version = None
    try:
        return check(_DIST[harness], version)
    except UnsupportedVersionError as exc:
        raise ImportError(f"the Apertus {harness} tasks: {exc}") from None
