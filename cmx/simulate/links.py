"""Shared resources (a PCIe link, a NIC, a drive) and the time one transfer takes over a path.

A resource is a FIFO server: a transfer reserves each resource on its path for its bytes at that
resource's bandwidth, in the order transfers arrive. The transfer itself runs at the path's
slowest bandwidth, after the path's latency. This keeps one
reservation per transfer (a transfer is a request's whole prefix from one source, never a
block or a token), so a thousand nodes simulate in seconds, and queueing still shows where
a resource is shared: two loads over one NIC take twice as long as one.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Resource", "io_bandwidth", "reserve"]


class Resource:
    __slots__ = ("name", "bandwidth", "free_at", "busy_s", "bytes")

    def __init__(self, name: str, bandwidth: float) -> None:
        if bandwidth <= 0:
            raise ValueError(f"{name}: bandwidth must be > 0, got {bandwidth}")
        self.name = name
        self.bandwidth = bandwidth  # bytes/s
        self.free_at = 0.0  # simulated time it finishes what it was given
        self.busy_s = 0.0  # total seconds reserved: utilization = busy_s / duration
        self.bytes = 0  # total bytes moved through it


def io_bandwidth(bandwidth: float, latency_s: float, io_bytes: int, depth: int) -> float:
    """Bytes/s of I/Os of ``io_bytes`` with ``depth`` in flight (Little's law), at most the
    device's ``bandwidth``: small I/Os at a shallow depth never reach the drive's speed."""
    per_io = latency_s + io_bytes / bandwidth
    return min(bandwidth, depth * io_bytes / per_io)


def reserve(path: Sequence[Resource], now: float, nbytes: int, latency_s: float,
            io_bytes: int, depth: int, per_io_wait_s: float = 0.0) -> float:
    """Reserve ``path`` for ``nbytes`` from ``now``; returns when the transfer ends.

    Each resource serves its transfers in order, each for ``nbytes / bandwidth`` of its own
    time; the transfer ends when its busiest resource has served it, and never sooner than
    its latency, its bytes at the path's I/O-limited speed and a wait of ``per_io_wait_s``
    per I/O, one after another (a round trip to another process that takes no CPU here). A
    slow resource's backlog does not hold the fast ones: a NIC stays free for others while a
    drive behind it catches up. The CPU a transfer takes is not a link's: it runs on its
    node's cores (``cores.Cores``).
    """
    if nbytes <= 0:
        return now
    slowest = min([r.bandwidth for r in path])
    bw = io_bandwidth(slowest, latency_s, io_bytes if io_bytes < nbytes else nbytes, depth)
    end = now + latency_s + nbytes / bw + -(-nbytes // io_bytes) * per_io_wait_s
    for r in path:
        held = nbytes / r.bandwidth
        free_at = r.free_at
        r.free_at = free_at = (free_at if free_at >= now else now) + held
        r.busy_s += held
        r.bytes += nbytes
        if free_at + latency_s > end:
            end = free_at + latency_s
    return end
