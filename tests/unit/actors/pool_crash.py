"""Pool nodes whose file calls, every node's, books and data plane both, go to one log.

A pool node keeps its books (``ExtentBooks``: index, journal, snapshot) and writes its blocks'
bytes (``ExtentPlane``) on descriptors of its own. Both are made here over one
``service_crash.ServiceFiles`` rooted at the plane's ``nvme_dir``, where every pool node keeps
its store (``pool-<id>``): the log holds every write and sync of every node in the order a disk
saw them, and ``crash_plane.crash_images`` rebuilds what a crash of the whole pool at any point
of it could leave. ``restart_pools`` starts the pool again over such an image, as Ray restarts
a dead pool node over its disk.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from unittest import mock

from plane import Plane
from service_crash import ServiceFiles
from tagging import start_pool

from cmx.actors.pool import node as pool_node
from cmx.actors.pool.node import PoolNodeService
from cmx.storage.nvme.dataplane import ExtentPlane
from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.extentio import ExtentIo
from cmx.storage.nvme.extents import ExtentBooks

__all__ = ["crash_pool", "recorded_pools", "restart_pools"]

IO_BYTES = 64 << 10


def recorded_pools(plane: Plane, members: Sequence[str]) -> tuple[dict[str, PoolNodeService],
                                                                  ServiceFiles]:
    """The pool nodes ``members`` on the plane (``tagging.start_pool``), each node's books and
    data plane making their file calls through one ``ServiceFiles``: its data plane writes on
    one I/O thread, so the log's order is the same at every run."""
    files = ServiceFiles(plane.config.nvme_dir)

    def data_plane() -> ExtentPlane:
        return ExtentPlane(io=ExtentIo(make_io_engine("threads", 1, IO_BYTES, files=files),
                                       IO_BYTES))

    with mock.patch.object(pool_node, "ExtentBooks", functools.partial(ExtentBooks, files=files)), \
            mock.patch.object(pool_node, "ExtentPlane", data_plane):
        return {m: start_pool(plane, m) for m in members}, files


def restart_pools(plane: Plane, root: str, members: Sequence[str]
                  ) -> dict[str, PoolNodeService]:
    """Every pool node anew over the stores under ``root`` (as the crash left them): a new
    epoch each, in the place of the old ones on the plane's link."""
    return {m: start_pool(plane, m, os.path.join(root, f"pool-{m}")) for m in members}


def crash_pool(pool: PoolNodeService) -> None:
    """Stop ``pool`` as a crash would: files released, nothing flushed, snapshotted or told
    to the directory."""
    pool.publisher.close()
    pool.store.books.teardown()
    pool.store.io.close()
    pool.io.close()
    pool.staging.close()
    pool.transport.close()
