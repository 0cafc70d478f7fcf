"""The evaluation adapter's part of the ``apertus`` command, contributed through the core's plugin hooks.

Registered in the ``apertus`` entry-point group, so ``apertus eval-path`` and ``apertus eval``
appear wherever this package is installed while the core imports nothing from the adapter.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from apertus_plugins.plugins.hooks import hookimpl


@hookimpl
def apertus_commands() -> Mapping[str, Callable[[argparse._SubParsersAction], None]]:
    from . import cli

    return {"eval-path": cli.add_eval_path, "eval": cli.add_eval}
