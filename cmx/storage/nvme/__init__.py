"""The local NVMe tier: a log-structured, crash-safe block store on O_DIRECT segment files.

Map of the package (who owns what):

- ``store``: NvmeStore, the thin facade; builds the parts below and forwards each call.
- ``books``: NvmeBooks, the control plane: lock, counters, operations in progress, and
  - ``index``: BlockIndex, committed entries, pins, eviction policy, sequence numbers;
  - ``segments``: SegmentSet, segment files, their record logs and live/pending/dead bytes;
  - ``space``: Space, making room (eviction, retiring segments, compaction);
  - ``durability``: Durability, flush, journal, snapshot (``journal``, ``records``,
    ``snapshot``), and ``recovery``, reopening (rebuilding a lost snapshot);
  - ``checks``: the self-check of segments against the index.
- ``extentio``: ExtentIo, the data plane: moves bytes between caller buffers and extents
  through an I/O engine (``io``: thread pool with preadv/pwritev; ``nixl_io``: NIXL POSIX
  io_uring; ``engines``: one by name), with ``staging`` for unaligned buffers.
- ``writes`` / ``blockreads`` / ``slices``: each operation's two phases around its bytes
  (``reads`` plans slice I/O; ``chunks``: extents and per-chunk checksums).
- ``extents``: ExtentBooks, the books alone, as the service's NVMe tier runs them; and
  ``dataplane``: ExtentPlane, the bytes of those books, moved in the node's data plane.
- ``front``: BooksFront, what NvmeStore and ExtentBooks answer alike (membership, stats,
  integrity, flush, close).
- ``files``: FileOps, every file system call (the crash tests' seam), and the directory's
  privacy rule; ``errors``: StoreIOError, StoreDirectoryError.
"""

from __future__ import annotations

from cmx.storage.nvme.engines import make_io_engine
from cmx.storage.nvme.errors import StoreDirectoryError, StoreIOError
from cmx.storage.nvme.io import IoBatch, IoEngine
from cmx.storage.nvme.store import NvmeLocation, NvmeStore

__all__ = ["IoBatch", "IoEngine", "NvmeLocation", "NvmeStore", "StoreDirectoryError",
           "StoreIOError", "make_io_engine"]
