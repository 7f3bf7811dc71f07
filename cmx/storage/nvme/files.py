"""FileOps: every file system call the NVMe store makes, one method each.

The store never calls ``os`` on its files directly: segments (through the I/O engine), record
logs, journal and snapshot all go through one ``FileOps``. That is the seam the crash tests
use: a subclass records each write and sync (and can fail any of them) so that the files a
power loss could leave are rebuilt and reopened. Every failure is raised as ``StoreIOError``
with its errno; files are created 0600 and never followed through a symlink.

``check_directory`` is the store's privacy rule: a store directory is the caller's own, 0700,
never a symlink.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import stat
from collections.abc import Callable
from typing import TypeVar

from cmx.storage.nvme.errors import StoreDirectoryError, StoreIOError

__all__ = ["FILE_MODE", "DIR_MODE", "FileOps", "check_directory"]

log = logging.getLogger(__name__)

FILE_MODE = 0o600  # segments, record logs, journal, snapshot, lock: the owner's alone
DIR_MODE = 0o700

_T = TypeVar("_T")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def _typed(what: str, call: Callable[[], _T]) -> _T:
    try:
        return call()
    except StoreIOError:
        raise
    except OSError as exc:
        raise StoreIOError(exc.errno, f"{what}: {exc.strerror or exc}") from exc


class FileOps:
    """Plain file system calls; a subclass may record or fail them (see the module doc)."""

    def open(self, path: str, flags: int, mode: int = FILE_MODE) -> int:
        fd = _typed(f"open {path}", lambda: os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC,
                                                    mode))
        if flags & (os.O_WRONLY | os.O_RDWR):  # an older store's file, or a wide umask
            try:
                if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                    os.fchmod(fd, mode)
            except OSError:
                os.close(fd)
                raise
        return fd

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        """One positional write; returns the bytes written (maybe fewer than asked)."""
        return _typed(f"write fd {fd} at {offset}", lambda: os.pwritev(fd, [data], offset))

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return _typed(f"read fd {fd} at {offset}", lambda: os.preadv(fd, [buf], offset))

    def fsync(self, fd: int) -> None:
        _typed(f"fsync fd {fd}", lambda: os.fsync(fd))

    def fdatasync(self, fd: int) -> None:
        _typed(f"fdatasync fd {fd}", lambda: os.fdatasync(fd))

    def ftruncate(self, fd: int, length: int) -> None:
        _typed(f"truncate fd {fd} to {length}", lambda: os.ftruncate(fd, length))

    def fallocate(self, fd: int, nbytes: int) -> bool:
        """Allocate ``[0, nbytes)`` of ``fd``; False where the file system cannot (never
        emulated by writing zeros: allocating ahead only speeds appends up)."""
        if _libc.fallocate(fd, 0, 0, nbytes) == 0:
            return True
        log.debug("fallocate of %d bytes: %s", nbytes, os.strerror(ctypes.get_errno()))
        return False

    def replace(self, src: str, dst: str) -> None:
        _typed(f"rename {src} -> {dst}", lambda: os.replace(src, dst))

    def unlink(self, path: str) -> None:
        _typed(f"unlink {path}", lambda: os.unlink(path))

    def fsync_dir(self, path: str) -> None:
        def call() -> None:
            fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        _typed(f"fsync directory {path}", call)

    def read_file(self, path: str) -> bytes | None:
        """The whole file, or None if it does not exist."""
        def call() -> bytes | None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    return f.read()
            finally:
                os.close(fd)

        return _typed(f"read {path}", call)

    # -- helpers built on the calls above ------------------------------------------------------

    def pwrite_all(self, fd: int, data: memoryview | bytes, offset: int) -> None:
        """Write all of ``data`` at ``offset``; a write that makes no progress is EIO."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self.pwrite(fd, view[done:], offset + done)
            if n <= 0:
                raise StoreIOError(5, f"short write at offset {offset + done} of fd {fd}")
            done += n

    def pread_all(self, fd: int, buf: memoryview, offset: int) -> None:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            n = self.pread(fd, view[done:], offset + done)
            if n <= 0:
                raise StoreIOError(5, f"short read at offset {offset + done} of fd {fd}")
            done += n


def check_directory(root: str) -> None:
    """Create ``root`` 0700 if missing; refuse one that is a symlink, not a directory, or
    owned by another user, or whose parent another user owns (who could swap it)
    (``StoreDirectoryError``); tighten an own one that is wider."""
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    owner = os.stat(parent).st_uid
    if owner not in (0, os.geteuid()):
        raise StoreDirectoryError(
            f"the parent {parent} of store directory {root} is owned by uid {owner}, who "
            f"could replace the store; refusing to use it"
        )
    try:
        os.mkdir(root, DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise StoreDirectoryError(f"store directory {root} is a symlink; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreDirectoryError(f"store directory {root} is not a directory")
    if st.st_uid != os.geteuid():
        raise StoreDirectoryError(
            f"store directory {root} is owned by uid {st.st_uid}, not by this process "
            f"(uid {os.geteuid()}); refusing to use it"
        )
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        log.warning("store directory %s was %o; made %o", root, stat.S_IMODE(st.st_mode),
                    DIR_MODE)
        os.chmod(root, DIR_MODE)
