"""The NIXL engine: NIXL's POSIX backend over io_uring, one loopback agent per engine.

Files are registered once as FILE memory (fd, whole file). DRAM buffers must be registered
before a transfer; registration is bookkeeping for this backend (~5 us), so each batch
registers its buffers and deregisters them when it completes. A batch of N pieces becomes
transfers of at most ``queue_depth`` descriptors, all posted at once: one large descriptor was
measured slow for writes (0.3 GB/s for 256 MiB), many smaller ones in flight are not.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time

from cmx.nixl_api import nixl_api
from cmx.storage.nvme.errors import StoreIOError
from cmx.storage.nvme.io import IoBatch, IoEngine, IoRequest

__all__ = ["NixlIoEngine"]

_names = itertools.count()
_POLL_SLEEP_S = 20e-6  # between polls of a running transfer: keeps a core free for hashing


class NixlIoEngine(IoEngine):
    name = "nixl"

    def __init__(self, queue_depth: int = 16, io_bytes: int = 4 << 20) -> None:
        super().__init__(queue_depth, io_bytes)
        api = nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        nixl_thread_sync_t = api.nixl_thread_sync_t

        self.agent_name = f"cmx-nvme-{os.getpid()}-{next(_names)}"
        # No progress thread: it spins a core, and file transfers progress when polled.
        config = nixl_agent_config(
            enable_prog_thread=False, backends=[],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(self.agent_name, config)
        self._agent.create_backend("POSIX", {"use_uring": "true"})
        self._files: dict[int, object] = {}
        self._lock = threading.Lock()

    def register_file(self, fd: int) -> None:
        with self._lock:
            if fd not in self._files:
                self._files[fd] = self._agent.register_memory([(0, 0, fd, "")], "FILE")

    def unregister_file(self, fd: int) -> None:
        with self._lock:
            reg = self._files.pop(fd, None)
        if reg is not None:
            self._agent.deregister_memory(reg)

    def _submit(self, op: str, pieces: list[IoRequest]) -> IoBatch:
        return _NixlBatch(self, "WRITE" if op == "write" else "READ", pieces)

    def close(self) -> None:
        with self._lock:
            regs = list(self._files.values())
            self._files.clear()
        for reg in regs:
            self._agent.deregister_memory(reg)
        self._agent = None  # the agent is destroyed with the object


class _NixlBatch(IoBatch):
    def __init__(self, engine: NixlIoEngine, op: str, pieces: list[IoRequest]) -> None:
        self._engine = engine
        agent = engine._agent
        self._agent = agent
        regions = {(buf.ctypes.data, buf.nbytes) for _, _, buf in pieces}
        self._reg = (
            agent.register_memory([(addr, n, 0, "") for addr, n in regions], "DRAM")
            if regions
            else None
        )
        self._handles: list[object] = []
        self._error: BaseException | None = None
        qd = engine.queue_depth
        try:
            for i in range(0, len(pieces), qd):
                group = pieces[i : i + qd]
                local = agent.get_xfer_descs(
                    [(buf.ctypes.data, buf.nbytes, 0) for _, _, buf in group], "DRAM"
                )
                remote = agent.get_xfer_descs(
                    [(off, buf.nbytes, fd) for fd, off, buf in group], "FILE"
                )
                handle = agent.initialize_xfer(op, local, remote, engine.agent_name)
                self._handles.append(handle)
                if agent.transfer(handle) == "ERR":
                    raise StoreIOError(errno.EIO, f"NIXL {op} failed to post")
        except BaseException as exc:  # finish what was posted before reporting
            self._error = exc

    def wait(self) -> None:
        agent = self._agent
        error = self._error
        for handle in self._handles:
            while True:
                try:
                    state = agent.check_xfer_state(handle)
                except Exception as exc:  # the bindings raise on backend errors
                    state, error = "ERR", error or exc
                if state == "DONE":
                    break
                if state == "ERR":
                    error = error or StoreIOError(errno.EIO, "NIXL transfer failed")
                    break
                time.sleep(_POLL_SLEEP_S)
            agent.release_xfer_handle(handle)
        self._handles = []
        if self._reg is not None:
            agent.deregister_memory(self._reg)
            self._reg = None
        if error is not None:
            if isinstance(error, StoreIOError):
                raise error
            raise StoreIOError(getattr(error, "errno", None) or errno.EIO,
                               f"NIXL transfer failed: {error}") from error
