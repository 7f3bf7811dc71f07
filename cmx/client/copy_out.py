"""The one place a reader checks what it uses: blocks copied from where they lie (shared-memory
slots, bytes a peer sent) into where they are used (a caller's KV tensor, an engine's paged
cache), each checked against its checksum in the same pass, and a failure handled here.

A block's payload is copied in pieces of about ``PIECE_BYTES`` (whole layers, or whole heads
for head-major payloads), and each piece is fed to the block's checksum right after it was
copied, while it is still in the CPU's cache: verifying costs the hash, not a second read of
the block from memory. A block whose checksum fails is not used: its place is zeroed (its
bytes landed before the check could fail), and the caller uses only the blocks before it.

Small blocks (several of them fit a piece; a million-token prefix is 62,500 blocks of
16 KiB) go a run at a time instead: the run's payloads gathered into one buffer that stays in
the cache, each block hashed there, and the blocks before the first that fails written to the
sink in one call (``Sink.put_run``): a failed block's bytes never land. One numpy call a run,
not one a block and layer: measured here, 62,500 blocks of 16 KiB cost 0.34 CPU-s in all
against 0.53 block by block (a warm memcpy of the same bytes: 0.09). A prefix pinned whole in
one tier comes as ``SlotRows``: its run is gathered from the arena's slots by index in one
call, with no view made per block.

Where the blocks land is a ``Sink``: ``TensorSink`` (a ``[layers, 2, kv_heads, tokens,
head_dim]`` tensor, the caller's or a new one) or an engine's paged cache
(``cmx.connectors.paged.PagedSink``), so that each byte crosses this process once. A load of
many blocks is copied on ``COPY_THREADS`` threads at once (numpy's copy and XXH3 run without
the GIL), each taking a run of blocks.

``empty_kv`` allocates a tensor on 4 KiB pages. Transparent huge pages were tried and
measured here: a 2 GiB tensor was touched in 0.10 s of CPU when the kernel had freed huge
pages at hand, but in 4.9 s when it had to find fresh ones, against 0.72-0.77 s on 4 KiB
pages every time. A caller that loads often passes a buffer of its own
(``NamespaceClient.load_into``): a warm buffer costs no page faults at all.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np
import xxhash

from cmx.buffers import Buffer
from cmx.checksum import ChecksumStream, checksum
from cmx.keys import BlockHash
from cmx.layout import KVLayout, PayloadOrder
from cmx.protocol import Loaded
from cmx.storage.arena import SharedArena, check_slots, slot_rows

__all__ = [
    "COPY_THREADS", "PIECE_BYTES", "Sink", "SlotRows", "TensorSink", "as_sink", "checked",
    "copy_block",
    "copy_payloads", "copy_verified", "empty_kv", "failed", "kv_array", "kv_bytes", "populate",
    "run_blocks",
]

log = logging.getLogger(__name__)

PIECE_BYTES = 512 << 10  # half of one core's L2 here: the piece is hashed before it leaves it
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))  # threads one load copies on, at most
THREADED_BYTES = 8 << 20  # a load smaller than this is copied on the caller's thread alone

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
POPULATE_MIN_BYTES = 1 << 20  # below this the faults cost less than the call

_libc: ctypes.CDLL | None = None
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class Sink(Protocol):
    """Where a load's blocks land, block ``i`` of the load at its own place. ``put`` is given
    block ``i``'s payload viewed as ``[layers, 2, kv_heads, block_tokens, head_dim]`` and cut
    by ``index`` (a piece: some layers, or some heads), as integers of ``itemsize`` bytes.
    A sink may raise from ``put`` (its load was cancelled): the load ends there."""

    itemsize: int
    blocks: int  # how many blocks it has places for

    def put(self, i: int, index: tuple[slice, ...], src: np.ndarray) -> None:
        """Copy ``src`` to the place ``index`` cuts of block ``i``'s place."""

    def put_run(self, i: int, rows: np.ndarray) -> None:
        """Copy whole layer-major payloads, ``rows[j]`` (bytes), to block ``i + j``'s place."""

    def clear(self, i: int) -> None:
        """Zero block ``i``'s place: its bytes failed their check."""


class TensorSink:
    """A CPU KV tensor ``[layers, 2, kv_heads, tokens, head_dim]``; block ``i`` of the load is
    its block ``first + i``."""

    def __init__(self, layout: KVLayout, out: Any, first: int = 0) -> None:
        self.T = layout.block_tokens
        self.dst = kv_bytes(out)
        self.first = first
        self.itemsize = self.dst.itemsize
        self.blocks = self.dst.shape[3] // self.T - first

    def place(self, i: int) -> np.ndarray:
        at = (self.first + i) * self.T
        return self.dst[:, :, :, at : at + self.T]

    def put(self, i: int, index: tuple[slice, ...], src: np.ndarray) -> None:
        np.copyto(self.place(i)[index], src)

    def put_run(self, i: int, rows: np.ndarray) -> None:
        at, n = (self.first + i) * self.T, len(rows)
        L, two, H, _, D = self.dst.shape
        dst = self.dst[:, :, :, at : at + n * self.T].reshape(L, two, H, n, self.T, D)
        np.copyto(dst, rows.reshape(n, L, two, H, self.T, D).transpose(1, 2, 3, 0, 4, 5))

    def clear(self, i: int) -> None:
        self.place(i).fill(0)


Payload = tuple[BlockHash, np.ndarray, int]  # (key, bytes in place, checksum)


class SlotRows(Sequence[Payload]):
    """Payloads of the same size lying in one arena's slots, in order (a prefix pinned whole
    in one tier): block ``i`` is ``rows[slots[i]]``. A run of them is gathered by index in one
    numpy call (``gather``); a payload is made only when asked for by index."""

    def __init__(self, keys: Sequence[BlockHash], buffer: np.ndarray, slot_bytes: int,
                 slots: np.ndarray, size: int, checksums: np.ndarray) -> None:
        check_slots(slots, len(buffer) // slot_bytes)
        self.keys = keys
        self.rows = slot_rows(buffer, slot_bytes, size)
        self.rows.flags.writeable = False  # a reader's view: it never writes a slot
        self.slots = slots
        self.size = size
        self.checksums = checksums

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.keys[i], self.rows[int(self.slots[i])], int(self.checksums[i])

    def gather(self, a: int, b: int) -> np.ndarray:
        """Payloads ``a`` to ``b``, copied into one buffer: [b - a, size] bytes."""
        return self.rows[self.slots[a:b]]


def as_sink(layout: KVLayout, out: Any) -> Sink:
    """``out`` as a sink: a KV tensor's blocks from its first, or ``out`` if it is one."""
    return TensorSink(layout, out) if _is_tensor(out) else out  # type: ignore[no-any-return]


def empty_kv(layout: KVLayout, tokens: int) -> Any:
    """An uninitialised [layers, 2, kv_heads, tokens, head_dim] tensor, its pages already
    mapped (``populate``)."""
    import torch

    kv = torch.empty(layout.shape(tokens), dtype=layout.torch_dtype())
    populate(kv.data_ptr(), kv.numel() * kv.element_size())
    return kv


def populate(address: int, nbytes: int) -> bool:
    """Map the pages of a fresh buffer in one call (``MADV_POPULATE_WRITE``, Linux 5.14)
    instead of one fault each as the copy first touches them: measured here, 0.32 CPU-s/GB
    against 0.40, and no two copy threads faulting at once. False where the kernel cannot
    (the copy then faults them in as before)."""
    global _libc
    page = mmap.PAGESIZE
    start = (address + page - 1) & ~(page - 1)
    end = (address + nbytes) & ~(page - 1)
    if end - start < POPULATE_MIN_BYTES:
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return bool(_libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                              MADV_POPULATE_WRITE) == 0)


def kv_array(kv: Any) -> np.ndarray:
    """A numpy view of a CPU KV tensor, its elements as integers of their size: numpy copies
    them on the calling thread, where torch's ``copy_`` would wake its OpenMP threads for
    every piece (here they spun for 4-50x the CPU time of the copy itself on a busy machine)."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[kv.element_size()]
    return kv.view(ints).numpy()


def kv_bytes(kv: Any) -> np.ndarray:
    """A numpy view of a CPU KV tensor (or a view of one) as bytes, its last dimension
    ``head_dim * element size`` long: numpy copies runs of bytes fastest (measured here, 20%
    less CPU than the same copy as 2-byte integers)."""
    import torch

    return kv.view(torch.uint8).numpy()  # type: ignore[no-any-return]


def failed(key: bytes, where: str = "where it was used") -> None:
    """Say once that a block failed its check; the caller uses nothing from it on."""
    log.warning("block %s failed its checksum %s", bytes(key).hex()[:12], where)


def checked(key: bytes, data: Buffer, want: int) -> bool:
    """Whether ``data`` (a block's bytes, or a selection of them, at hand) has checksum
    ``want``; a failure is said (``failed``)."""
    if checksum(data) == want:
        return True
    failed(key)
    return False


def copy_block(layout: KVLayout, payload: np.ndarray, sink: Sink, i: int,
               want: int | None) -> bool:
    """Copy one block's payload to block ``i`` of ``sink``, piece by piece, each hashed right
    after it was copied; whether its checksum is ``want`` (``None``: not checked, True)."""
    ints = {1: np.uint8, 2: np.int16, 4: np.int32}[sink.itemsize]
    src = payload.view(ints).reshape(*layout.payload_shape[:-1], -1)
    if layout.order is PayloadOrder.LAYER_MAJOR:
        outer, count = 0, layout.num_layers  # the payload's outermost dimension, in dst
    else:
        src, outer, count = src.transpose(1, 2, 0, 3, 4), 2, layout.num_kv_heads
    unit = layout.block_bytes // count
    step = max(1, PIECE_BYTES // unit)
    stream = ChecksumStream() if want is not None else None
    index: list[slice] = [slice(None)] * 5
    for a in range(0, count, step):
        n = min(step, count - a)
        index[outer] = slice(a, a + n)
        cut = tuple(index)
        sink.put(i, cut, src[cut])
        if stream is not None:
            stream.feed(payload[a * unit : (a + n) * unit])
    return stream is None or stream.value() == want


def copy_payloads(layout: KVLayout, payloads: Sequence[tuple[BlockHash, np.ndarray, int]],
                  out: Any, first: int = 0, verify: bool = True) -> int:
    """Copy block payloads (key, bytes, checksum) to ``out`` (a ``Sink``, or a KV tensor),
    the first to its block ``first``, each checked as it is copied. How many leading blocks
    were copied whole: the first that fails is cleared and said, and nothing after it counts.
    ``verify=False`` skips the checks: only to measure what they cost."""
    sink = as_sink(layout, out)
    bad = _bad(layout, payloads, sink, first, verify)
    for i in bad:  # its bytes landed before the check failed: none of them stay
        sink.clear(first + i)
        failed(payloads[i][0])
    return min(bad, default=len(payloads))


def copy_verified(layout: KVLayout, arena: SharedArena, blocks: Sequence[Loaded], out: Any,
                  first: int = 0, verify: bool = True) -> tuple[int, list[Loaded]]:
    """Copy the blocks of a load out of ``arena`` to ``out`` (as ``copy_payloads``), each
    checked as it is copied. Returns (blocks copied whole, the corrupt one if any)."""
    payloads = [(b.key, arena.slot_view(b.slot)[: b.size], b.checksum) for b in blocks]
    n = copy_payloads(layout, payloads, out, first, verify)
    return n, list(blocks[n : n + 1])


def _bad(layout: KVLayout, payloads: Sequence[tuple[BlockHash, np.ndarray, int]],
         sink: Sink, first: int, verify: bool) -> list[int]:
    """The indices of the payloads that failed their check (none: all copied whole). A load
    of ``THREADED_BYTES`` or more runs on several threads, each a run of blocks that stops at
    its own first failure: the first of the list ends the load, and every one is cleared."""
    runs = run_blocks(layout)

    rows = isinstance(payloads, SlotRows) and payloads.size == layout.block_bytes

    def run(start: int, stop: int) -> list[int]:
        i = start
        while i < stop:
            n = min(runs, stop - i)
            if n > 1 and (rows or all(_whole(layout, p) for _, p, _ in payloads[i : i + n])):
                good = _copy_run(payloads, i, n, sink, first + i, verify)
                if good < n:
                    return [i + good]
                i += n
                continue
            _, payload, want = payloads[i]
            if not copy_block(layout, payload, sink, first + i, want if verify else None):
                return [i]
            i += 1
        return []

    n = len(payloads)
    threads = min(COPY_THREADS, n)
    if threads < 2 or n * layout.block_bytes < THREADED_BYTES:
        return run(0, n)
    bounds = [n * t // threads for t in range(threads + 1)]
    jobs = [_threads().submit(run, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
    try:
        mine = run(bounds[0], bounds[1])  # the caller's thread takes the first run
    finally:
        wait(jobs)  # none writes behind the caller's back once this returns or raises
    return sorted([*mine, *(i for j in jobs for i in j.result())])


def run_blocks(layout: KVLayout) -> int:
    """How many blocks are copied together (a load's ``_copy_run``, a store's
    ``TensorSource.copy_run``): as many as fit a piece, where two blocks do and the payload is
    layer-major; else 1 (block by block)."""
    per_piece = PIECE_BYTES // max(1, layout.block_bytes)
    return per_piece if per_piece > 1 and layout.order is PayloadOrder.LAYER_MAJOR else 1


def _whole(layout: KVLayout, payload: np.ndarray) -> bool:
    """Whether ``payload`` is a whole block's bytes, as a run gathers them."""
    return payload.dtype == np.uint8 and payload.shape == (layout.block_bytes,)


def _copy_run(payloads: Sequence[Payload], a: int, n: int, sink: Sink, i: int,
              verify: bool) -> int:
    """Gather whole payloads ``a`` to ``a + n`` into one buffer (it stays in the cache), hash
    each there, and write the ones before the first that fails to blocks ``i``.. of ``sink``
    in one call; how many were written. ``verify=False``: all, unchecked."""
    if isinstance(payloads, SlotRows):
        rows = payloads.gather(a, a + n)
        want = payloads.checksums[a : a + n].tolist() if verify else []
    else:
        run = payloads[a : a + n]
        rows = np.stack([p for _, p, _ in run])
        want = [w for _, _, w in run]
    good = n
    if verify:
        got = map(xxhash.xxh3_64_intdigest, rows)
        good = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), n)
    if good:
        sink.put_run(i, rows[:good])
    return good


def _is_tensor(out: Any) -> bool:
    import torch

    return isinstance(out, torch.Tensor)


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(COPY_THREADS - 1 or 1, thread_name_prefix="cmx-copy")
        return _pool
