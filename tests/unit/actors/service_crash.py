"""The NVMe tier as the service splits it, with both halves' file calls recorded in one log.

The tier actor's books (``NvmeTierService`` over ``ExtentBooks``) write the journal, record
logs and snapshot and fdatasync the segments; the agent's data plane (``ExtentPlane``, under
``HostBytes``) writes the blocks' bytes into the segments on descriptors of its own. Both go
through one ``ServiceFiles`` (the storage tests' ``crash_plane.PlaneFiles``), so the log holds
every write and sync in the order a disk saw them, and ``crash_plane.crash_images`` rebuilds
what a power loss at any point of it could leave.
"""

from __future__ import annotations

import functools
import os
import sys
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

from plane import Plane, make_plane

from cmx.actors.tiers import nvme as nvme_tier
from cmx.actors.tiers.nvme import NvmeTierService
from cmx.config import ServiceConfig
from cmx.links import actor_name
from cmx.storage.nvme.dataplane import ExtentPlane
from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.extents import ExtentBooks
from cmx.tiers import Tier

# The crash plane lives with the NVMe store's tests; this replay reuses it as it is.
_STORAGE_TESTS = str(Path(__file__).resolve().parents[1] / "storage")
if _STORAGE_TESTS not in sys.path:
    sys.path.append(_STORAGE_TESTS)
from crash_plane import Op, PlaneFiles, crash_images  # noqa: E402

__all__ = ["NODE", "ServiceFiles", "crash", "crash_images", "live_tier", "recorded_plane",
           "restart_nvme", "surviving_plane", "written_segments"]

NODE = f"crash-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host


class ServiceFiles(PlaneFiles):
    """``PlaneFiles`` for both halves of the tier. The agent's data plane opens the segment
    files itself, so a write is named by what its descriptor points at (a number the tier
    closed may have been handed to the agent since)."""

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        with self._lock:
            self.paths[fd] = self._rel(os.readlink(f"/proc/self/fd/{fd}"))
        return super().pwrite(fd, data, offset)


def recorded_plane(config: ServiceConfig, io_bytes: int, staging_bytes: int
                   ) -> tuple[Plane, ServiceFiles]:
    """One node's plane (``plane.make_plane``) whose NVMe tier keeps its books, and whose
    agent writes the blocks, through one ``ServiceFiles``: the agent's writes on one I/O
    thread, so the log's order is the same at every run."""
    files = ServiceFiles(os.path.join(config.nvme_dir, NODE))
    # NvmeTierService makes its ExtentBooks itself: the class it makes them with gets the files.
    with mock.patch.object(nvme_tier, "ExtentBooks", functools.partial(ExtentBooks, files=files)):
        plane = make_plane(config, nodes=(NODE,))
    host = plane.agents[NODE].host
    host.nvme.close()
    host.nvme = ExtentPlane(io=ExtentIo(make_io_engine("threads", 1, io_bytes, files=files),
                                        staging_bytes))
    return plane, files


@contextmanager
def restart_nvme(plane: Plane, root: str) -> Iterator[NvmeTierService]:
    """A new NVMe tier over ``root`` in the place of the node's, as Ray restarts a dead tier
    actor while the agent runs on: the agent's writes now reach it. After, it stops as a
    crash would (no flush, no snapshot) and the old one is put back."""
    cfg = plane.config
    name = actor_name("nvme", NODE)
    old = plane.link._targets[name]  # type: ignore[attr-defined]
    tier = NvmeTierService(NODE, root, cfg.nvme_bytes, cfg.block_bytes, plane.link,
                           cfg.directory_shards, segment_bytes=cfg.nvme_segment_bytes,
                           lease_s=cfg.lease_s, clock=plane.clock)
    plane.link._targets[name] = tier  # type: ignore[attr-defined]
    try:
        yield tier
    finally:
        plane.link._targets[name] = old  # type: ignore[attr-defined]
        crash(tier)


def crash(tier: NvmeTierService) -> None:
    """Stop ``tier`` as a crash would: files released, nothing flushed or snapshotted."""
    tier.store.books.teardown()
    tier.store.io.close()


def written_segments(log: list[Op], upto: int) -> set[str]:
    """The segment files the agent wrote in ``log[:upto]`` (the tier writes none itself)."""
    return {op.path for op in log[:upto] if op.kind == "write" and op.path.endswith(".dat")}


def surviving_plane(root: str, written: Iterable[str]) -> ExtentPlane:
    """The data plane of an agent that outlived its tier: a descriptor held open on each
    segment file it wrote, as its cache keeps them; one of a file deleted since is open on
    the deleted file (made and unlinked here)."""
    nvme = ExtentPlane(engine="threads", queue_depth=4)
    for name in sorted(written):
        path = os.path.join(root, name)
        made = not os.path.exists(path)
        if made:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        nvme.read_at(path, [])  # opened and cached, nothing read
        if made:
            os.unlink(path)
    return nvme


def live_tier(plane: Plane) -> NvmeTierService:
    return plane.tiers[(NODE, Tier.NVME)]
