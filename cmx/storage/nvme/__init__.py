"""The local NVMe tier: a log-structured, crash-safe block store on O_DIRECT segment files.

Map of the package:

- ``store``: NvmeStore, the public surface (put, put_many, pins, delete).
- ``blockreads``: whole-block reads (get, get_into, get_many, get_many_into).
- ``slices``: ``read_runs``, slice reads verified per chunk; ``reads`` plans their I/O.
- ``core``: opening, closing, flush and snapshot; the locks.
- ``books``: index, pins, segments and counters; stats and ``check_integrity``.
- ``space``: making room: eviction through the policy, retiring segments, compaction.
- ``segments``: segment files and their live/pending/dead accounting.
- ``journal`` / ``snapshot`` / ``recovery``: the persistent index and reopening.
- ``io`` / ``nixl_io``: I/O engines (thread pool with preadv/pwritev; NIXL POSIX io_uring).
- ``chunks``: extents and per-chunk checksums.
- ``staging``: aligned allocation and the bounded staging buffer.
"""

from __future__ import annotations

from cmx.storage.nvme.io import IoBatch, IoEngine, make_io_engine
from cmx.storage.nvme.store import NvmeLocation, NvmeStore

__all__ = ["IoBatch", "IoEngine", "NvmeLocation", "NvmeStore", "make_io_engine"]
