"""Agent telemetry as NIXL configures it: whether it is on, and where events go.

An agent's telemetry is on when ``NIXL_TELEMETRY_ENABLE`` says so (``y``, ``yes``,
``on``, ``1``, ``true``, ``enable``; case insensitive) and off when it says no (``n``,
``no``, ``off``, ``0``, ``false``, ``disable``) *whatever the agent's*
``captureTelemetry`` says; unset, ``captureTelemetry`` decides. Any other value is a
``RuntimeError`` when the agent is created, as in NIXL.

With telemetry on, ``getXferTelemetry`` answers and the agent's events go to a sink:

- ``NIXL_TELEMETRY_DIR`` set (and ``NIXL_TELEMETRY_EXPORTER`` unset, empty or
  ``BUFFER``): NIXL's shared-memory ring file ``<dir>/<agent name>``
  (``_core.TelemetryRing``; ``NIXL_TELEMETRY_BUFFER_SIZE`` events, default 4096, a power
  of two), which NIXL's ``telemetry_reader`` examples read;
- otherwise, or with ``NIXL_TELEMETRY_EXPORTER=NOP``: none (collected per request only).

Other exporters (NIXL's ``prometheus`` plugins) are not provided: naming one is a
``RuntimeError``. Events, as NIXL emits them: ``agent_memory_registered`` /
``agent_memory_deregistered`` (bytes of one call), per completed transfer
``agent_xfer_post_time`` and ``agent_xfer_time`` (microseconds), ``agent_tx_bytes`` or
``agent_rx_bytes`` (WRITE / READ) and ``agent_tx_requests_num`` /
``agent_rx_requests_num`` (1), and ``agent_err_*`` (1) for each call that fails. Events
are written when they happen (NIXL stages them and flushes every 100 ms).
"""

from __future__ import annotations

import os
from typing import Optional

from . import _core

__all__ = ["TELEMETRY_VERSION", "enabled", "open_sink", "error_event"]

#: The ring format's version (NIXL's ``TELEMETRY_VERSION``).
TELEMETRY_VERSION = 4
DEFAULT_BUFFER_SIZE = 4096

# nixl_telemetry_event_type_t
AGENT_TX_BYTES = 0
AGENT_RX_BYTES = 1
AGENT_TX_REQUESTS_NUM = 2
AGENT_RX_REQUESTS_NUM = 3
AGENT_MEMORY_REGISTERED = 4
AGENT_MEMORY_DEREGISTERED = 5
AGENT_XFER_TIME = 6
AGENT_XFER_POST_TIME = 7
# AGENT_ERR_NOT_POSTED (8) ... AGENT_ERR_NO_TELEMETRY (19): status -1 ... -12.
_FIRST_ERROR_EVENT = 8
_LAST_ERROR_STATUS = -12

_POSITIVE = ("y", "yes", "on", "1", "true", "enable")
_NEGATIVE = ("n", "no", "off", "0", "false", "disable")


def env_flag(name: str) -> Optional[bool]:
    """A yes/no environment variable as NIXL reads it: None when unset, RuntimeError for
    a value it does not know (the empty string included)."""
    value = os.environ.get(name)
    if value is None:
        return None
    if value.lower() in _POSITIVE:
        return True
    if value.lower() in _NEGATIVE:
        return False
    raise RuntimeError(
        f"Conversion to bool failed for string '{value}' known are {', '.join(_POSITIVE)} "
        f"as positive and {', '.join(_NEGATIVE)} as negative (case insensitive)"
    )


def enabled(capture_telemetry: bool) -> bool:
    """Whether an agent configured with ``capture_telemetry`` has telemetry on."""
    forced = env_flag("NIXL_TELEMETRY_ENABLE")
    return bool(capture_telemetry) if forced is None else forced


def _buffer_size() -> int:
    value = os.environ.get("NIXL_TELEMETRY_BUFFER_SIZE")
    if value is None:
        return DEFAULT_BUFFER_SIZE
    try:
        size = int(value)
    except ValueError:
        raise RuntimeError(
            f"NIXL_TELEMETRY_BUFFER_SIZE must be a number of events, not '{value}'"
        ) from None
    if size <= 0:
        raise RuntimeError("Telemetry buffer size cannot be 0")
    return size


def open_sink(agent_name: str) -> Optional["_core.TelemetryRing"]:
    """The ring file an agent with telemetry on writes to, or None (no sink set)."""
    exporter = os.environ.get("NIXL_TELEMETRY_EXPORTER", "")
    if exporter.upper() == "NOP":
        return None
    if exporter and exporter.upper() != "BUFFER":
        raise RuntimeError(
            f"Failed to load telemetry plugin: {exporter} (this build has BUFFER and NOP)"
        )
    directory = os.environ.get("NIXL_TELEMETRY_DIR")
    if directory is None:
        if exporter:
            raise RuntimeError("The BUFFER telemetry exporter needs NIXL_TELEMETRY_DIR")
        return None
    size = _buffer_size()
    try:
        return _core.TelemetryRing(
            os.path.join(directory, agent_name), size, TELEMETRY_VERSION
        )
    except (ValueError, OSError) as e:
        raise RuntimeError(f"Failed to create telemetry exporter: BUFFER ({e})") from e


def error_event(status: int) -> Optional[int]:
    """The ``agent_err_*`` event of a NIXL error status (None for other values)."""
    if _LAST_ERROR_STATUS <= status < 0:
        return _FIRST_ERROR_EVENT - 1 - status
    return None
