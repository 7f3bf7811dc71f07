"""Fallbacks the service runs on, named once: the actors report them, the admin API shows them
in ``/readyz`` and as the ``cmx_degraded`` metric, ``cmx status`` prints them.

A part that falls back logs a warning and carries ``degraded = "<kind>: <why>"`` in its stats
(``AgentStats.degraded``, ``TierStats.degraded``: ``cmx.stats``).
"""

from __future__ import annotations

import errno
import os
import tempfile
from enum import Enum

__all__ = ["Fallback", "describe", "direct_io_refused", "parse"]


class Fallback(str, Enum):
    OBJECT_STORE_TRANSPORT = "object_store_transport"  # NIXL did not start: bytes via Ray
    BUFFERED_IO = "buffered_io"  # the filesystem refuses O_DIRECT: the page cache in between


def describe(kind: Fallback, why: str) -> str:
    return f"{kind.value}: {why}"


def parse(text: str) -> tuple[str, str]:
    """(kind, why) of a ``describe`` string."""
    kind, _, why = text.partition(": ")
    return kind, why


def direct_io_refused(folder: str) -> str | None:
    """Why files in ``folder`` cannot be opened with O_DIRECT (tmpfs cannot), or None."""
    fd, path = tempfile.mkstemp(prefix=".direct-probe-", dir=folder)
    os.close(fd)
    try:
        probe = os.open(path, os.O_RDWR | os.O_DIRECT)
        os.close(probe)
        return None
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return f"{folder} refuses O_DIRECT ({exc.strerror})"
    finally:
        os.unlink(path)
