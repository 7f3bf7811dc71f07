"""NIXL (UCX) read bandwidth between two processes of this machine: the peer link's speed.

Measured with the service's own transport (``NixlTransport``: its lanes, its pieces, its
prepared descriptor lists), as the link a peer load crosses, without the service around it:
a child process registers a buffer of slots and hands its ``PeerInfo`` over a pipe; this
process reads every slot, three times, and takes the median. Anything that fails is reported, not
raised: the calibration then uses the copy speed for the link and says so.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

__all__ = ["nixl_read_rate"]

PIECE = 2 << 20


def _owner(conn: Any, nbytes: int, slot_bytes: int) -> None:
    from cmx.actors.transport.base import Region
    from cmx.actors.transport.nixl_ucx import NixlTransport
    from cmx.buffers import aligned_empty

    transport = NixlTransport("cmx-calibrate-owner")
    buf = aligned_empty(nbytes)
    buf[:] = 1
    transport.register(Region("owner", buf.ctypes.data, slot_bytes, nbytes // slot_bytes), buf)
    conn.send(transport.info())
    conn.recv()  # the reader is done
    transport.close()


def _read(reader: Any, peer: Any, nbytes: int, slot_bytes: int) -> list[float]:
    from cmx.actors.transport.base import Move, Region
    from cmx.buffers import aligned_empty

    local = aligned_empty(nbytes)
    local[:] = 0
    slots = nbytes // slot_bytes
    reader.register(Region("reader", local.ctypes.data, slot_bytes, slots), local)
    moves = [Move("owner", i, "reader", i) for i in range(slots)]
    times = []
    for _ in range(4):  # the first connects; three are timed
        t0 = time.perf_counter()
        reader.read(peer, moves, 60.0)
        times.append(time.perf_counter() - t0)
    if int(local[:: 1 << 20].min()) != 1:
        raise RuntimeError("NIXL read returned other bytes")
    return times[1:]


def nixl_read_rate(nbytes: int, slot_bytes: int = 16 << 20) -> tuple[float | None, str]:
    """(bytes/s, how) of the service's NIXL transport between two processes; (None, why) if
    it cannot run."""
    try:
        from cmx.actors.transport.nixl_ucx import LANES, PIECE_BYTES, NixlTransport

        reader = NixlTransport("cmx-calibrate-reader")
    except Exception as exc:  # noqa: BLE001 - NIXL absent or broken: say so, use the copy
        return None, f"NIXL unavailable ({exc}); the link is taken at the copy speed"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, nbytes, slot_bytes), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the owner process sent no metadata in 120 s")
        peer = parent.recv()
        times = _read(reader, peer, nbytes, slot_bytes)
        return nbytes / statistics.median(times), (
            f"the service's transport (NixlTransport, UCX, {LANES} lanes, "
            f"{PIECE_BYTES >> 20} MiB pieces) between two processes, {nbytes >> 20} MiB in "
            f"{slot_bytes >> 20} MiB slots, median of 3")
    except Exception as exc:  # noqa: BLE001
        return None, f"NIXL read failed ({exc}); the link is taken at the copy speed"
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        reader.close()
