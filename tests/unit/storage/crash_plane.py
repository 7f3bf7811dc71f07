"""A crash plane for the NVMe store: record its file calls, rebuild what a power loss leaves.

``PlaneFiles`` is a ``FileOps`` (the store's own file layer, not a mock of the store) that
logs every write, truncate, sync, create, rename and unlink the store makes, and can fail the
n-th write or sync with an errno. ``crash_image`` replays a prefix of that log into a fresh
directory the way a power loss could leave it:

- ``all``: every call of the prefix reached the disk;
- ``synced``: each file keeps only what its last fsync/fdatasync covered;
- ``torn``: as ``synced``, plus the first half of each file's first unsynced write.

Names (create, rename, unlink) are taken as durable in log order: the store fsyncs the
directory after each, before anything depends on it.
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from cmx.storage.nvme.errors import StoreIOError
from cmx.storage.nvme.files import FileOps

MODES = ("all", "synced", "torn")


@dataclass
class Op:
    kind: str  # write, truncate, sync, create, rename, unlink, allocate
    path: str
    offset: int = 0
    data: bytes = b""
    length: int = 0
    dst: str = ""


class PlaneFiles(FileOps):
    """Records the store's file calls; fails call number ``fail_at`` (writes and syncs
    counted together, from 0) with ``fail_errno``. A failed write first writes part of its
    bytes (whole 512-byte sectors), as a write that runs out of space does."""

    def __init__(self, root: str, fail_at: int | None = None,
                 fail_errno: int = errno_mod.EIO) -> None:
        self.root = os.fspath(root)
        self.log: list[Op] = []
        self.paths: dict[int, str] = {}
        self.calls = 0  # writes and syncs so far
        self.fail_at = fail_at
        self.fail_errno = fail_errno
        self.failed: list[str] = []  # what was failed, for messages
        self.failed_at = -1  # the log's length when the fault struck
        self.kinds: list[str] = []  # what each faultable call was ("write", "sync", ...)
        self._lock = threading.Lock()

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def _faultable(self, what: str) -> None:
        with self._lock:
            n = self.calls
            self.calls += 1
            self.kinds.append(what.split()[0])
        if n == self.fail_at:
            self.failed.append(what)
            self.failed_at = len(self.log)
            raise StoreIOError(self.fail_errno, f"injected {os.strerror(self.fail_errno)}: "
                                                f"{what}")

    def _log(self, op: Op) -> None:
        with self._lock:
            self.log.append(op)

    # -- the calls -----------------------------------------------------------------------------

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        rel = self._rel(path)
        with self._lock:
            self.paths[fd] = rel
        if flags & os.O_CREAT:
            self._log(Op("create", rel))
        if flags & os.O_TRUNC:
            self._log(Op("truncate", rel, length=0))
        return fd

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        path = self.paths.get(fd, "?")
        try:
            self._faultable(f"write {path} at {offset}")
        except StoreIOError:  # as a full disk does: part of the write lands, then the error
            half = memoryview(data).cast("B")[: len(data) // 2 // 512 * 512]
            if len(half):
                super().pwrite(fd, half, offset)
                self._log(Op("write", path, offset, bytes(half)))
            raise
        n = super().pwrite(fd, data, offset)
        self._log(Op("write", path, offset, bytes(memoryview(data).cast("B")[:n])))
        return n

    def fsync(self, fd: int) -> None:
        path = self.paths.get(fd, "?")
        self._faultable(f"fsync {path}")
        super().fsync(fd)
        self._log(Op("sync", path))

    def fdatasync(self, fd: int) -> None:
        path = self.paths.get(fd, "?")
        self._faultable(f"fdatasync {path}")
        super().fdatasync(fd)
        self._log(Op("sync", path))

    def ftruncate(self, fd: int, length: int) -> None:
        path = self.paths.get(fd, "?")
        self._faultable(f"truncate {path}")
        super().ftruncate(fd, length)
        self._log(Op("truncate", path, length=length))

    def fallocate(self, fd: int, nbytes: int) -> bool:
        done = super().fallocate(fd, nbytes)
        if done:
            self._log(Op("allocate", self.paths.get(fd, "?"), length=nbytes))
        return done

    def replace(self, src: str, dst: str) -> None:
        self._faultable(f"rename {src}")
        super().replace(src, dst)
        self._log(Op("rename", self._rel(src), dst=self._rel(dst)))

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self._log(Op("unlink", self._rel(path)))


@dataclass(eq=False)
class _Inode:
    current: bytearray = field(default_factory=bytearray)
    durable: bytearray = field(default_factory=bytearray)
    unsynced: list[Op] = field(default_factory=list)
    version: int = 0  # bumped by every change of ``current``
    durable_version: int = 0


def _apply(buf: bytearray, op: Op, tear: bool = False) -> None:
    if op.kind == "write":
        data = op.data[: len(op.data) // 2] if tear else op.data
        end = op.offset + len(data)
        if len(buf) < end:
            buf.extend(bytes(end - len(buf)))
        buf[op.offset : end] = data
    elif op.kind == "truncate":
        del buf[op.length :]
        buf.extend(bytes(op.length - len(buf)))
    elif op.kind == "allocate" and len(buf) < op.length:
        buf.extend(bytes(op.length - len(buf)))


def crash_images(log: list[Op]) -> Iterator[tuple[int, str, Callable[[str], None]]]:
    """For each prefix of ``log`` and each mode, the image a power loss could leave:
    (prefix length, mode, a function that writes it into an empty directory). Images equal
    to one already yielded are skipped (a sync changes nothing in "all", a write nothing
    in "synced")."""
    names: dict[str, _Inode] = {}
    seen: set[tuple] = set()
    for upto in range(len(log) + 1):
        if upto:
            _step(names, log[upto - 1])
        for mode in MODES:
            state = tuple(sorted(
                (name, id(node), node.version if mode == "all" else node.durable_version,
                 id(_first_write(node)) if mode == "torn" else 0)
                for name, node in names.items()
            ))
            if state in seen:
                continue
            seen.add(state)
            files = {name: _contents(node, mode) for name, node in names.items()}
            yield upto, mode, partial(_write_image, files)


def _step(names: dict[str, _Inode], op: Op) -> None:
    if op.kind == "create":
        names.setdefault(op.path, _Inode())
    elif op.kind == "rename":
        names[op.dst] = names.pop(op.path)
    elif op.kind == "unlink":
        names.pop(op.path, None)
    elif op.kind == "sync":
        node = names[op.path]
        node.durable = bytearray(node.current)
        node.durable_version = node.version
        node.unsynced = []
    elif op.path in names:
        node = names[op.path]
        _apply(node.current, op)
        node.unsynced.append(op)
        node.version += 1


def _first_write(node: _Inode) -> Op | None:
    return next((op for op in node.unsynced if op.kind == "write"), None)


def _contents(node: _Inode, mode: str) -> bytes:
    if mode == "all":
        return bytes(node.current)
    data = bytearray(node.durable)
    first = _first_write(node)
    if mode == "torn" and first is not None:
        _apply(data, first, tear=True)
    return bytes(data)


def _write_image(files: dict[str, bytes], into: str) -> None:
    os.makedirs(into, mode=0o700, exist_ok=True)
    for name, data in files.items():
        fd = os.open(os.path.join(into, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def crash_image(log: list[Op], upto: int, mode: str, into: str) -> None:
    """Write into the empty directory ``into`` the files a power loss after ``log[:upto]``
    could leave, in ``mode`` (see the module docstring)."""
    names: dict[str, _Inode] = {}
    for op in log[:upto]:
        _step(names, op)
    _write_image({name: _contents(node, mode) for name, node in names.items()}, into)
