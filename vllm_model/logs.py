"""The adapter's messages in ``vllm serve``'s own output, at vLLM's log level.

vLLM attaches its handler (format, stream, ``VLLM_LOGGING_LEVEL``, ``--log-level``) to the ``vllm``
logger only, which does not propagate; a plugin module's ``logging.getLogger(__name__)`` has no
handler, so its info lines are lost. The adapter's modules log under :data:`LOGGER`, a child of
``vllm`` made with vLLM's ``init_logger`` (``info_once`` and friends included); the core's loggers
(``apertus_plugins.*``) are forwarded to it in every vLLM process (:func:`route_package_logs`, called
by :func:`vllm_model.register`), so they too show with vLLM's format and level.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.logger import init_logger

__all__ = ["LOGGER", "get_logger", "route_package_logs"]

#: The logger the adapter's messages go to: under vLLM's ``vllm`` logger, so they share its handler and level.
LOGGER = "vllm.apertus_plugins"
#: The framework-free package whose loggers are forwarded to :data:`LOGGER` in a vLLM process.
PACKAGE = "apertus_plugins"


def get_logger(module: str) -> Any:
    """vLLM's logger for one adapter module (``vllm_model.renderer`` -> ``vllm.apertus_plugins.renderer``)."""
    return init_logger(f"{LOGGER}.{module.rpartition('.')[2]}")


class _ToVLLM(logging.Handler):
    """Hands a record of the core's loggers to :data:`LOGGER` when vLLM's level (read now) lets it through."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(LOGGER)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_package_logs() -> bool:
    """Forward the ``apertus_plugins`` loggers to vLLM's handler, at vLLM's level; True when newly done.

    Idempotent. The records keep their logger name; they stop propagating to the root logger (vLLM's
    handler prints them once), and the level test is vLLM's, made per record, so a later
    ``--log-level`` or ``VLLM_LOGGING_LEVEL`` applies.
    """
    package = logging.getLogger(PACKAGE)
    if any(isinstance(h, _ToVLLM) for h in package.handlers):
        return False
    package.addHandler(_ToVLLM())
    package.setLevel(logging.DEBUG)  # the level test is vLLM's, in the handler
    package.propagate = False
    return True
