"""``cmx.sentinel``: a cleanup runs once every watched process is gone, not before, even when a
watched process is killed together with its whole process group (as Ray kills a worker)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmx.sentinel import POLL_S, after_exit, identity

BOUND_S = 30.0  # for a sentinel to see its processes gone and clean up, on a loaded machine


def sleeper(**popen: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                            **popen)  # type: ignore[call-overload]


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file the cleanups under test remove."""
    path = tmp_path / "marker"
    path.write_text("left behind")
    return path


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def gone_within(path: Path, bound_s: float = BOUND_S) -> bool:
    deadline = time.monotonic() + bound_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def test_the_cleanup_runs_once_every_watched_process_is_gone_and_not_before(
    marker: Path, sleepers: list[subprocess.Popen[bytes]],
) -> None:
    first, second = sleeper(), sleeper()
    sleepers.extend([first, second])
    assert after_exit([first.pid, second.pid], functools.partial(os.unlink, marker))
    first.kill()
    first.wait()
    time.sleep(4 * POLL_S)
    assert marker.exists()  # the second one runs yet
    second.kill()
    second.wait()
    assert gone_within(marker)


def test_it_outlives_the_process_group_of_the_process_it_watches(marker: Path) -> None:
    script = textwrap.dedent(f"""
        import functools, os, time
        from cmx.sentinel import after_exit
        assert after_exit([os.getpid()], functools.partial(os.unlink, {str(marker)!r}))
        print("watched", flush=True)
        time.sleep(300)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "watched\n"
        assert marker.exists()
    finally:
        os.killpg(owner.pid, signal.SIGKILL)  # the owner and everything in its group
        owner.wait()
    assert gone_within(marker)


def test_nothing_is_started_for_processes_already_gone(marker: Path) -> None:
    gone = sleeper()
    gone.kill()
    gone.wait()
    assert not after_exit([gone.pid], functools.partial(os.unlink, marker))
    assert marker.exists()


def test_a_process_is_known_by_its_start_and_a_zombie_is_gone() -> None:
    me = identity(os.getpid())
    assert me is not None and me[0] == os.getpid() and me == identity(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + BOUND_S
    while identity(child.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)  # exited, not waited for yet: a zombie
    assert identity(child.pid) is None and child.poll() == 0
