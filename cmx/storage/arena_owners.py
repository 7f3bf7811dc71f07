"""Who owns an arena, and what happens to its arenas once the owner is gone.

Every arena's header page names the process that created it (``HEADER``: magic, version,
owner pid, slot bytes, slots). ``watch_owner``, called by a process before its first arena,
starts a sentinel (``cmx.sentinel``) that unlinks every arena naming that process once it is
gone, however it went; ``reap_orphans`` is that unlinking, also run by a tier starting on this
host for every owner that is gone. An arena of unknown owner (pid 0), of a running process, or
a file that is no arena is left alone.
"""

from __future__ import annotations

import functools
import os
import stat
import struct
import threading

from cmx.sentinel import after_exit, identity

__all__ = ["HEADER", "MAGIC", "SHM_DIR", "VERSION", "owner_of", "reap_orphans",
           "unlink_prefixed", "watch_owner"]

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux
HEADER = struct.Struct("<8sIIQQ")  # magic, version, owner pid (0: unknown), slot_bytes, slots
MAGIC = b"CMXARENA"
VERSION = 1
_watched = 0  # the process whose arenas a sentinel unlinks once it is gone (``watch_owner``)
_watch_lock = threading.Lock()


def _unlocked_in_child() -> None:
    """A child forked while another thread held ``_watch_lock`` would find it held forever."""
    global _watch_lock
    _watch_lock = threading.Lock()


os.register_at_fork(after_in_child=_unlocked_in_child)


def owner_of(name: str, shm_dir: str = SHM_DIR) -> int | None:
    """The pid of the process that created the arena ``name`` (0: unknown); None where ``name``
    is not an arena (or is gone)."""
    try:  # never blocks (a FIFO) nor follows a link: only a regular file can be an arena
        fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, HEADER.size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < HEADER.size:
        return None
    magic, _, pid, _, _ = HEADER.unpack(head)
    return int(pid) if magic == MAGIC else None


def reap_orphans(prefix: str = "cmx-", shm_dir: str = SHM_DIR, owner: int | None = None
                 ) -> list[str]:
    """Unlink the arenas under ``prefix`` whose owner process no longer exists (only those of
    the process ``owner``, where given); their names.

    An arena of unknown owner (pid 0), of a live pid, or that is not an arena is left alone.
    A reused pid keeps an orphan a while longer, never removes a live arena.
    """
    reaped: list[str] = []
    try:
        names = sorted(n for n in os.listdir(shm_dir) if n.startswith(prefix))
    except OSError:
        return reaped
    for name in names:
        pid = owner_of(name, shm_dir)
        if not pid or owner not in (None, pid) or _alive(pid):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except OSError:
            continue
        reaped.append(name)
    return reaped


def unlink_prefixed(prefix: str, shm_dir: str = SHM_DIR) -> None:
    """Remove every shared-memory name under ``prefix``: what an earlier incarnation of a
    process that is one of its kind on this host (a node's tier) left behind when it was
    killed. A reader still mapping one keeps its mapping until it maps the new one."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(shm_dir, name))
            except OSError:
                pass


def watch_owner() -> None:
    """Once per process that creates arenas, before its first: a sentinel that unlinks what
    this process left once it is gone (``cmx.sentinel``). The sentinel starts outside the
    lock: a child forked meanwhile gets the lock free and starts its own."""
    global _watched
    pid = os.getpid()
    with _watch_lock:
        if _watched == pid:  # a forked child is a process of its own
            return
        _watched = pid
    # Every arena of it, whatever its name: only this pid's are read as its.
    after_exit([pid], functools.partial(reap_orphans, "", owner=pid))


def _alive(pid: int) -> bool:
    return identity(pid) is not None  # a zombie holds no mapping: gone
