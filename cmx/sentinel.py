"""A cleanup that runs once some processes are gone, however they went: what shared memory needs
when its processes can be killed together with everything they started.

The process that makes a shared-memory segment unlinks it as it exits, and multiprocessing's
resource tracker does when it is killed; but Ray kills a worker together with its process group,
the tracker among it, and a cluster torn down (``serve run`` stopped, ``ray stop``) kills every
worker at once: nothing of theirs is left to unlink what they made, and it stays in RAM until
reboot. ``after_exit(pids, cleanup)`` starts a sentinel: a small interpreter in a session of its
own whose parent exits at once, so it is in no watched process's group or tree. It waits until
every one of ``pids`` has exited (a pidfd each, or /proc looked at every ``POLL_S`` where the
kernel gives none), runs ``cleanup`` once and exits.

A raylet run as a subreaper (a deprecated Ray setting) kills its workers' sentinels as it kills
any orphan under it: what they would have unlinked waits for the next reap on that host.

The sentinel knows only that the processes it watched are gone: leaving alone what a live
process still uses is the cleanup's part (``cmx.storage.arena.reap_orphans``,
``cmx.operate.orphans.EngineSegments.reap``). A process is told apart from a later one of the
same pid by its start time, so a reused pid neither holds a cleanup back nor lets it run early.

The cleanup travels pickled (a function of a module, or a ``functools.partial`` of one) and is
unpickled only once the processes are gone, with the caller's ``sys.path``; until then the
sentinel has imported the standard library only (it is run from its file, not through the
package, whose import pulls in numpy), holds no file of the caller's open and sits in ``/``.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
from collections.abc import Callable, Iterable

__all__ = ["POLL_S", "after_exit", "identity"]

PROC_DIR = "/proc"
POLL_S = 0.5  # how often a process without a pidfd is looked for
START_TIMEOUT_S = 30.0  # for the sentinel to take what it is given and leave its parent

Identity = tuple[int, int]  # (pid, start time in clock ticks after boot)

# This file run on its own: ``python -m cmx.sentinel`` would import the package first.
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1])['main'](sys.argv[2:])"


def identity(pid: int, proc_dir: str = PROC_DIR) -> Identity | None:
    """``pid`` and its start time while it runs; None once it has exited (a zombie included:
    it holds nothing any more) or where there is no such process."""
    try:
        with open(os.path.join(proc_dir, str(pid), "stat")) as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count after its ")".
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return pid, int(fields[19])


def after_exit(pids: Iterable[int], cleanup: Callable[[], object]) -> bool:
    """Start a sentinel that calls ``cleanup`` once every process of ``pids`` that runs now has
    exited. False where none was started (none of them runs, or the sentinel could not start):
    the cleanup is then left to whoever reaps next."""
    procs = [p for p in map(identity, pids) if p is not None]
    if not procs:
        return False
    payload = pickle.dumps((list(sys.path), pickle.dumps(cleanup)))
    argv = [sys.executable, "-c", _BOOT, os.path.abspath(__file__),
            *(f"{pid}:{start}" for pid, start in procs)]
    try:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
    except OSError:
        return False
    try:
        child.communicate(payload, timeout=START_TIMEOUT_S)  # it exits once it has forked
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return False
    return child.returncode == 0


def main(argv: list[str]) -> None:
    """The sentinel: ``pid:start`` of each process to wait for as arguments, the pickled
    (``sys.path``, cleanup) on stdin."""
    payload = sys.stdin.buffer.read()
    procs = [(int(pid), int(start)) for pid, start in (a.split(":") for a in argv)]
    if os.fork():
        os._exit(0)  # its parent's exit tells ``after_exit`` the sentinel runs
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    wait_gone(procs)
    path, cleanup = pickle.loads(payload)
    sys.path[:] = path
    pickle.loads(cleanup)()


def wait_gone(procs: list[Identity]) -> None:
    """Return once none of ``procs`` runs."""
    poller = select.poll()
    watched: set[int] = set()
    polled: list[Identity] = []
    for proc in procs:
        try:
            fd = os.pidfd_open(proc[0])
        except (AttributeError, OSError):  # no pidfd here (Linux < 5.3), or it is gone
            polled.append(proc)
            continue
        if identity(proc[0]) != proc:  # it exited before its pidfd was opened
            os.close(fd)
            continue
        poller.register(fd, select.POLLIN)  # readable once the process has exited
        watched.add(fd)
    while watched or polled:
        # With no pidfd registered, the poll only sleeps: /proc is looked at again after it.
        for fd, _ in poller.poll(POLL_S * 1000 if polled else None):
            poller.unregister(fd)
            os.close(fd)
            watched.discard(fd)
        polled = [p for p in polled if identity(p[0]) == p]
