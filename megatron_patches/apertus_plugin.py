"""The Megatron adapter's part of the ``apertus`` command, contributed through the core's plugin hooks.

Registered in the ``apertus`` entry-point group, so ``apertus convert`` appears wherever this
package is installed while the core itself imports nothing from the adapter.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from apertus_plugins.plugins.hooks import hookimpl


@hookimpl
def apertus_commands() -> Mapping[str, Callable[[argparse._SubParsersAction], None]]:
    from . import cli

    return {"convert": cli.add_parser}
