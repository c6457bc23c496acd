"""NIXL's logging helper (``nixl.logging``): ``get_logger(name)``.

``get_logger(__name__)`` returns a logger under this package's (``rdma_nixl``), the one
the package's own modules log to, and on first use gives that logger NIXL's output: a
handler printing to stdout as ``<time> NIXL <LEVEL> <file>:<line> <message>``, level
INFO, not propagated to the root logger. ``NIXL_LOG_LEVEL`` (``TRACE``, ``DEBUG``,
``INFO``, ``WARN``, ``ERROR``, ``FATAL``; TRACE is DEBUG) sets the level; an unknown
value is reported and the default kept.

The package configures nothing until ``get_logger`` is called (importing ``rdma_nixl``
leaves logging as the application set it up).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["get_logger", "setup_logging", "PACKAGE_LOGGER"]

#: The logger every ``get_logger`` logger is a child of.
PACKAGE_LOGGER = "rdma_nixl"

_FORMAT = "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}

_configured = False
_lock = threading.Lock()


class _StdoutHandler(logging.StreamHandler):
    """Writes to the current ``sys.stdout`` at each record (so redirections and test
    capture made after setup still see the output)."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging() -> None:
    """Gives the package logger NIXL's handler and level (once; later calls do nothing)."""
    global _configured
    with _lock:
        if _configured:
            return
        logger = logging.getLogger(PACKAGE_LOGGER)
        handler = _StdoutHandler()
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        wanted = os.environ.get("NIXL_LOG_LEVEL")
        if wanted:
            level = _LEVELS.get(wanted.upper())
            if level is None:
                logger.warning(
                    "Invalid NIXL_LOG_LEVEL value '%s'. Using configuration default.", wanted
                )
            else:
                logger.setLevel(level)
                handler.setLevel(level)
                logger.info("Log level set to %s from NIXL_LOG_LEVEL environment variable",
                            wanted.upper())
        _configured = True


def get_logger(name: str) -> logging.Logger:
    """The logger ``rdma_nixl.<name>`` (leading underscores dropped: ``_api`` gives
    ``rdma_nixl.api``), with the package's output set up on first use."""
    setup_logging()
    clean = str(name).lstrip("_")
    if clean.startswith(PACKAGE_LOGGER + "."):
        clean = clean[len(PACKAGE_LOGGER) + 1 :]
    return logging.getLogger(f"{PACKAGE_LOGGER}.{clean}" if clean else PACKAGE_LOGGER)
