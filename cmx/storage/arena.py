"""A named shared-memory arena of fixed-size slots, and the allocator that hands the slots out.

The DRAM tier keeps its blocks in one arena; the node's offload agent maps the same bytes by
name and moves them (to NVMe, to another node) without a copy through the tier's process.
Layout of the shared file::

    [header page: magic, version, owner pid, slot_bytes, num_slots][slot 0][slot 1]...[slot n-1]

Slots are multiples of 4 KiB and the mapping is page-aligned, so every slot can go straight to
O_DIRECT I/O, and ``buffer`` (all slots) is one region for a single NIXL registration.

Ownership: ``create`` makes the file and owns it; ``attach`` maps an existing one. The owner
unlinks (``unlink`` or its context manager); if it never does, the file is unlinked when the
owner's arena is garbage collected or its process exits, and the multiprocessing resource
tracker unlinks it if the owner process dies, unless the tracker is killed with it (Ray kills a
worker with its process group, and every worker of a node torn down). So the first ``create``
of a process starts a sentinel (``cmx.sentinel``) that unlinks, once that process is gone
however it went, every arena whose header names it (``arena_owners``); a tier starting on
this host also removes arenas whose owner pid is gone (``reap_orphans``).
``attach`` never registers with the tracker: on Python 3.11 ``SharedMemory`` registers every
attach, the tracker keeps one entry per name shared with spawned children, and a child
unregistering its attach drops the owner's entry too.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker

import numpy as np

from cmx.buffers import ALIGN, align_up
from cmx.errors import (
    BlockStateError,
    BlockTooLargeError,
    LayoutMismatchError,
    StoreClosedError,
    StoreFullError,
)
from cmx.storage.arena_owners import (
    HEADER,
    MAGIC,
    SHM_DIR,
    VERSION,
    owner_of,
    reap_orphans,
    unlink_prefixed,
    watch_owner,
)

# The owners' part (``arena_owners``) is named here too: callers find an arena's whole surface
# in one module.
__all__ = ["SHM_DIR", "SharedArena", "SlotAllocator", "SlotRef", "check_slots", "owner_of",
           "read_slot", "reap_orphans", "slot_rows", "unlink_prefixed"]

HEADER_BYTES = ALIGN  # one page, so slot 0 starts page-aligned
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")  # no "/" (a path) and no ":" (tracker protocol)


@dataclass(frozen=True)
class SlotRef:
    """Where a committed block lies, for a process that attaches the arena by name."""

    arena: str  # shared-memory name of the arena
    slot: int  # slot index
    offset: int  # byte offset of the slot in the arena's ``buffer``
    size: int  # payload bytes, at most the slot size
    checksum: int | None = None  # XXH3-64 of the payload where known
    copy: int = 0  # names this copy of the block apart from any later one of the same key


class SlotAllocator:
    """O(1) alloc and free of slot indexes from a free list; lowest indexes go out first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() is O(1)
        self._in_use = bytearray(num_slots)  # 1 where the slot is allocated
        self._used = 0

    @property
    def capacity(self) -> int:
        return len(self._in_use)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self._used

    def is_used(self, slot: int) -> bool:
        return 0 <= slot < len(self._in_use) and bool(self._in_use[slot])

    def alloc(self) -> int:
        if not self._free:
            raise StoreFullError(f"all {self.capacity} slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = 1
        self._used += 1
        return slot

    def release(self, slot: int) -> None:
        if not self.is_used(slot):
            raise BlockStateError(f"slot {slot} is not allocated (capacity {self.capacity})")
        self._in_use[slot] = 0
        self._free.append(slot)
        self._used -= 1

    def check_integrity(self) -> None:
        free, cap = len(self._free), self.capacity
        if self._used + free != cap:
            raise AssertionError(f"used {self._used} + free {free} != capacity {cap}")
        marked = sum(self._in_use)
        if marked != self._used:
            raise AssertionError(f"{marked} slots marked in use, counter says {self._used}")
        distinct = set(self._free)
        if len(distinct) != free:
            raise AssertionError(f"free list holds {free} entries, {len(distinct)} distinct")
        bad = [s for s in distinct if not 0 <= s < cap or self._in_use[s]]
        if bad:
            raise AssertionError(f"{len(bad)} free-listed slots out of range or in use: {bad[:5]}")


class SharedArena:
    """``num_slots`` slots of ``slot_bytes`` in named POSIX shared memory.

    Use ``create`` (owner) or ``attach`` (another process), not the constructor.
    """

    def __init__(self, name: str, mm: mmap.mmap, slot_bytes: int, num_slots: int,
                 owner: bool) -> None:
        self._name = name
        self._mm: mmap.mmap | None = mm
        self._slot_bytes = slot_bytes
        self._num_slots = num_slots
        self._owner = owner
        self._buffer: np.ndarray | None = np.frombuffer(
            mm, dtype=np.uint8, count=slot_bytes * num_slots, offset=HEADER_BYTES
        )
        # the owner's safety net: unlink when this object is collected or the process exits
        self._finalizer = weakref.finalize(self, _unlink, name, True) if owner else None

    # -- life cycle ----------------------------------------------------------------------------

    @classmethod
    def create(cls, capacity_bytes: int, slot_bytes: int, name: str | None = None,
               populate: bool = True) -> SharedArena:
        """A new arena of ``capacity_bytes // align_up(slot_bytes)`` slots.

        ``populate`` faults every page in now, so the first write to a slot runs at memcpy
        speed instead of paying a page fault per 4 KiB.
        """
        _check_positive(capacity_bytes=capacity_bytes, slot_bytes=slot_bytes)
        watch_owner()
        slot_bytes = align_up(slot_bytes)
        num_slots = capacity_bytes // slot_bytes
        if num_slots == 0:
            raise BlockTooLargeError(
                f"capacity {capacity_bytes} bytes holds no slot of {slot_bytes} bytes"
            )
        name = name if name is not None else f"cmx-{os.getpid()}-{secrets.token_hex(6)}"
        _check_name(name)
        path = _path(name)
        total = HEADER_BYTES + num_slots * slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mm = mmap.mmap(fd, total, flags=flags)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        mm[: HEADER.size] = HEADER.pack(MAGIC, VERSION, os.getpid(), slot_bytes, num_slots)
        resource_tracker.register("/" + name, "shared_memory")
        return cls(name, mm, slot_bytes, num_slots, owner=True)

    @classmethod
    def attach(cls, name: str, populate: bool = False) -> SharedArena:
        """Map an arena another process created. Closing it never unlinks the owner's file.

        ``populate`` maps every page now: a process that will touch the whole arena (the agent,
        which moves every block) then pays no fault per 4 KiB on its first transfers.
        """
        _check_name(name)
        fd = os.open(_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ValueError(f"shared memory {name!r} is {size} bytes, not a cmx arena")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        magic, version, _, slot_bytes, num_slots = HEADER.unpack_from(mm, 0)
        expected = HEADER_BYTES + slot_bytes * num_slots
        if magic != MAGIC or version != VERSION or size != expected:
            mm.close()
            raise ValueError(
                f"shared memory {name!r} is not a cmx arena v{VERSION} "
                f"(magic {magic!r}, version {version}, {size} bytes, header says {expected})"
            )
        return cls(name, mm, slot_bytes, num_slots, owner=False)

    def close(self) -> None:
        """Unmap. Views handed out keep the mapping alive until they are gone. Idempotent."""
        self._buffer = None
        if self._mm is not None:
            mm, self._mm = self._mm, None
            try:
                mm.close()
            except BufferError:
                pass  # numpy views still export it; the mapping goes with the last of them

    def unlink(self) -> None:
        """Remove the name; mappings stay valid until closed. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # runs _unlink once, then never again
        elif not self._owner:
            _unlink(self._name, registered=False)

    def __enter__(self) -> SharedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()

    # -- the bytes -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def owner(self) -> bool:
        return self._owner

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def buffer(self) -> np.ndarray:
        """All slots as one writable uint8 array (no copy): one NIXL registration."""
        if self._buffer is None:
            raise StoreClosedError(f"arena {self._name} is closed")
        return self._buffer

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in ``buffer``."""
        if not 0 <= slot < self._num_slots:
            raise IndexError(f"slot {slot} out of range 0..{self._num_slots - 1}")
        return slot * self._slot_bytes

    def slot_view(self, slot: int) -> np.ndarray:
        """Writable uint8 view of the whole slot (no copy); valid while the arena is open."""
        offset = self.slot_offset(slot)
        return self.buffer[offset : offset + self._slot_bytes]

    def read(self, slot: int, size: int) -> np.ndarray:
        """A copy of the first ``size`` bytes of ``slot``."""
        if not 0 <= size <= self._slot_bytes:
            raise BlockTooLargeError(f"size {size} outside 0..{self._slot_bytes}")
        return self.slot_view(slot)[:size].copy()


def slot_rows(buffer: np.ndarray, slot_bytes: int, size: int) -> np.ndarray:
    """An arena's ``buffer`` as one row per slot, each the slot's first ``size`` bytes: a view
    (writable where ``buffer`` is), for gathering or writing many slots in one numpy call.
    LayoutMismatchError unless ``0 < size <= slot_bytes``: wider rows would overlap."""
    if not 0 < size <= slot_bytes:
        raise LayoutMismatchError(f"a payload of {size} bytes does not fit in a slot of "
                                  f"{slot_bytes}")
    return np.lib.stride_tricks.as_strided(
        buffer, (len(buffer) // slot_bytes, size), (slot_bytes, 1),
        writeable=buffer.flags.writeable)


def check_slots(slots: np.ndarray | list[int], num_slots: int) -> None:
    """IndexError unless every slot is one of ``num_slots`` (numpy would wrap a negative one)."""
    if len(slots) and not 0 <= int(min(slots)) <= int(max(slots)) < num_slots:
        raise IndexError(f"a slot out of range 0..{num_slots - 1}")


def read_slot(ref: SlotRef) -> np.ndarray:
    """Attach ``ref.arena``, copy the block out and detach: what another process calls."""
    arena = SharedArena.attach(ref.arena)
    try:
        if arena.slot_offset(ref.slot) != ref.offset:
            raise ValueError(f"{ref} does not match arena slot size {arena.slot_bytes}")
        return arena.read(ref.slot, ref.size)
    finally:
        arena.close()


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"arena name must be 1-200 of [A-Za-z0-9._-], got {name!r}")


def _check_positive(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


def _unlink(name: str, registered: bool) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass
    if registered:
        resource_tracker.unregister("/" + name, "shared_memory")
