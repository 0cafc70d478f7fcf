"""Apertus 1.5 evaluation for upstream lm-eval (0.4.x) and lmms-eval (0.7.x).

- :mod:`eval_tasks.catalogue` (``catalogue.yaml``): every benchmark of the report's evaluation
  tables, its setting, the upstream task its Apertus variant derives from (or why there is none)
  and the report's numbers for the released 8B;
- :mod:`eval_tasks.derive`: the task folders for ``--include_path "$(apertus eval-path lm_eval)"``
  and ``"$(apertus eval-path lmms_eval)"``, generated from the installed harness's own task configs
  (``include:``) with the protocol on top; :mod:`eval_tasks.lm_eval.protocol` and
  :mod:`eval_tasks.lmms_eval.common` are the derived tasks' classes, ``lm_eval/*/`` this package's
  own tasks where upstream has none;
- :mod:`eval_tasks.lmms_model`: the lmms-eval model ``apertus`` (entry point ``lmms_eval.models``);
- :mod:`eval_tasks.report`: ``apertus eval report``, the report's tables against a served model;
- :mod:`eval_tasks.data`: where each task finds its local data, with clear errors;
- :mod:`eval_tasks.cli`: ``apertus eval-path`` and ``apertus eval`` (the ``apertus_commands`` hook).

The protocol facts (thinking stripping, answer extraction, the degeneration metric, call
scoring, mean@k, the audio caps, the length-controlled win rate) live in
:mod:`apertus_plugins.posttrain.evaluation`; this package only plugs them in.
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
