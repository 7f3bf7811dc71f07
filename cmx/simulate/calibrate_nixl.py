"""NIXL (UCX) read bandwidth between two processes of this machine: the peer link's speed.

A child process registers a buffer with its NIXL agent and hands its metadata and descriptors
over a pipe; this process reads the whole buffer in 2 MiB descriptors, as the service's
transport does, three times, and takes the median. Anything that fails is reported, not
raised: the calibration then uses the copy speed for the link and says so.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

__all__ = ["nixl_read_rate"]

PIECE = 2 << 20


def _owner(conn: Any, nbytes: int) -> None:
    from cmx.nixl_api import nixl_api

    api = nixl_api()
    agent = api.nixl_agent("cmx-calibrate-owner", api.nixl_agent_config(backends=["UCX"]))
    buf = np.ones(nbytes, np.uint8)
    addr = buf.ctypes.data
    agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
    descs = agent.get_xfer_descs([(addr + off, PIECE, 0) for off in range(0, nbytes, PIECE)],
                                 "DRAM")
    conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(descs)))
    conn.recv()  # the reader is done


def _read(reader: Any, api: Any, nbytes: int, meta: bytes, remote_descs: bytes) -> list[float]:
    local = np.zeros(nbytes, np.uint8)
    addr = local.ctypes.data
    reader.register_memory([(addr, nbytes, 0, "")], "DRAM")
    name = reader.add_remote_agent(meta)
    name = name.decode() if isinstance(name, bytes) else name
    remote = reader.deserialize_descs(remote_descs)
    descs = reader.get_xfer_descs([(addr + off, PIECE, 0) for off in range(0, nbytes, PIECE)],
                                  "DRAM")
    times = []
    for _ in range(4):  # the first connects; three are timed
        t0 = time.perf_counter()
        handle = reader.initialize_xfer("READ", descs, remote, name)
        if reader.transfer(handle) == "ERR":
            raise RuntimeError("NIXL transfer could not start")
        deadline = time.monotonic() + 60
        while (state := reader.check_xfer_state(handle)) != "DONE":
            if state == "ERR" or time.monotonic() > deadline:
                raise RuntimeError(f"NIXL transfer ended in {state}")
            time.sleep(20e-6)
        times.append(time.perf_counter() - t0)
        reader.release_xfer_handle(handle)
    if int(local[:: 1 << 20].min()) != 1:
        raise RuntimeError("NIXL read returned other bytes")
    return times[1:]


def nixl_read_rate(nbytes: int) -> tuple[float | None, str]:
    """(bytes/s, how) of NIXL UCX reads between two processes; (None, why) if it cannot run."""
    try:
        from cmx.nixl_api import nixl_api

        api = nixl_api()
        reader = api.nixl_agent("cmx-calibrate-reader", api.nixl_agent_config(backends=["UCX"]))
    except Exception as exc:  # noqa: BLE001 - NIXL absent or broken: say so, use the copy
        return None, f"NIXL unavailable ({exc}); the link is taken at the copy speed"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, nbytes), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the owner process sent no metadata in 120 s")
        meta, descs = parent.recv()
        times = _read(reader, api, nbytes, meta, descs)
        return nbytes / statistics.median(times), \
            f"UCX between two processes, {nbytes >> 20} MiB in 2 MiB descriptors, median of 3"
    except Exception as exc:  # noqa: BLE001
        return None, f"NIXL read failed ({exc}); the link is taken at the copy speed"
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
