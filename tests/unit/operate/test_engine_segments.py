"""The reaping rule of ``EngineSegments`` on files in a temporary directory standing for
/dev/shm, held by real processes (a child that maps a file or holds it open, this process):
a recorded segment is unlinked only once every process of its record is gone and no live
process maps it or holds it open; a segment no record names is never touched; a replica killed
with its engine is reaped by the sentinel it left (``watch``)."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cmx.operate.orphans import EngineSegments, ReapedSegment, is_engine_segment

HOLDER = """
import mmap, os, sys
maps, fds = [], []
for path in sys.argv[2:]:
    fd = os.open(path, os.O_RDWR)
    if sys.argv[1] == "map":
        maps.append(mmap.mmap(fd, 0))
        os.close(fd)
    else:
        fds.append(fd)
print("ready", flush=True)
sys.stdin.read()
"""


# A replica: its engine (HOLDER, mapping the segment) under it, recorded and watched.
REPLICA = """
import subprocess, sys, time
from cmx.operate.orphans import EngineSegments
root, shm, segment, holder = sys.argv[1:5]
engine = subprocess.Popen([sys.executable, "-c", holder, "map", segment],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert engine.stdout.readline() == "ready\\n"
segments = EngineSegments(root, shm_dir=shm)
record = segments.record([engine.pid])
print("watched" if record and segments.watch(record) else "not watched", flush=True)
time.sleep(300)
"""


class Holder:
    """A child process that maps (or only opens) files until its stdin closes."""

    def __init__(self, how: str, *paths: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, how, *map(str, paths)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def let_go(self) -> None:
        """Close its stdin: it exits on its own (not waited for here)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.fixture
def segments(tmp_path: Path, shm: Path) -> EngineSegments:
    return EngineSegments(str(tmp_path / "records"), shm_dir=str(shm))


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for h in started:
        h.stop()


def make(shm: Path, name: str, size: int = 4096) -> Path:
    path = shm / name
    path.write_bytes(b"\1" * size)
    return path


def test_a_dead_engines_segments_are_reaped_and_nothing_else(
    segments: EngineSegments, shm: Path, holders: list[Holder],
) -> None:
    queue, lock = make(shm, "psm_0a1b", 8192), make(shm, "sem.mp-x1y2", 32)
    other, stranger = make(shm, "cmx-arena"), make(shm, "psm_stranger")  # no record names
    engine = Holder("map", queue, lock, other)
    bystander = Holder("open", other)  # lives on, holds no segment (as the resource tracker)
    holders.extend([engine, bystander])
    record = segments.record([engine.pid, bystander.pid])
    assert record is not None
    data = json.loads(Path(record).read_text())
    assert data["segments"] == ["psm_0a1b", "sem.mp-x1y2"]
    assert [pid for pid, _ in data["processes"]] == [engine.pid]

    assert segments.reap() == []  # its process lives
    assert queue.exists() and lock.exists()
    engine.stop()
    assert sorted(segments.reap(), key=lambda r: r.name) == [
        ReapedSegment("psm_0a1b", 8192), ReapedSegment("sem.mp-x1y2", 32)]
    assert not queue.exists() and not lock.exists() and not Path(record).exists()
    assert other.exists() and stranger.exists()
    assert segments.reap() == []


def test_a_tensor_parallel_engines_rank_buffers_are_reaped_too(
    segments: EngineSegments, shm: Path, holders: list[Holder],
) -> None:
    """vLLM's CPU build at TP=3 leaves each rank's shared buffer when its processes are
    killed: recorded from the workers that map them, and reaped once they are gone."""
    names = [f"vllm_dist_x7q2-pg0-[0-1-2]-cpushm_{rank}" for rank in range(3)]
    buffers = [make(shm, name, 8192) for name in names]
    workers = [Holder("map", b) for b in buffers]
    holders.extend(workers)
    assert segments.record([w.pid for w in workers]) is not None
    for w in workers:
        w.stop()
    assert sorted(r.name for r in segments.reap()) == names
    assert not any(b.exists() for b in buffers)


def test_a_rank_buffer_an_engine_takes_again_while_reaping_is_kept(
    segments: EngineSegments, shm: Path, holders: list[Holder],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank buffer is named by the engine's port: an engine started on the same port maps
    the name again between the reaper's look at who holds what and its unlink. The reaper
    asks afresh just before unlinking such a name, and keeps it."""
    name = "vllm_dist_29500-pg0-[0-1]-cpushm_0"
    buffer = make(shm, name)
    worker = Holder("map", buffer)
    holders.append(worker)
    assert segments.record([worker.pid]) is not None
    worker.stop()
    looks = iter([set(), {name}])  # free at the first look, taken by the second
    monkeypatch.setattr(segments, "_held_by_anyone", lambda: next(looks))
    assert segments.reap() == []
    assert buffer.exists()


def test_only_vllms_rank_buffer_names_count_as_its_segments() -> None:
    assert is_engine_segment("vllm_dist_x7q2-pg0-[0-1-2]-cpushm_2")
    assert is_engine_segment("29500-pg1-[0-1]-cpushm")
    assert not is_engine_segment("my-cpushm-notes")
    assert not is_engine_segment("cmx-hbm-0a1b-cpushm")


def test_a_segment_a_live_process_maps_or_holds_open_is_kept_until_it_lets_go(
    segments: EngineSegments, shm: Path, holders: list[Holder],
) -> None:
    mapped, opened = make(shm, "psm_mapped"), make(shm, "psm_opened")
    engine = Holder("map", mapped, opened)
    holders.append(engine)
    assert segments.record([engine.pid]) is not None
    engine.stop()
    with open(mapped, "r+b") as f:
        view = mmap.mmap(f.fileno(), 0)  # this process maps one
    fd = os.open(opened, os.O_RDONLY)  # ... and holds the other open
    try:
        assert segments.reap() == []
        assert mapped.exists() and opened.exists()
    finally:
        view.close()
    assert segments.reap() == [ReapedSegment("psm_mapped", 4096)]
    os.close(fd)
    assert segments.reap() == [ReapedSegment("psm_opened", 4096)]


def test_a_recorded_pid_now_of_another_process_counts_as_gone(
    segments: EngineSegments, shm: Path, holders: list[Holder],
) -> None:
    make(shm, "psm_reused"), make(shm, "psm_live")
    alive = Holder("open")
    holders.append(alive)
    os.makedirs(segments.root)
    start = int(Path(f"/proc/{alive.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    for name, (pid, began) in {"psm_reused": (alive.pid, start - 1),
                               "psm_live": (alive.pid, start)}.items():
        Path(segments.root, f"{name}.json").write_text(
            json.dumps({"processes": [[pid, began]], "segments": [name]}))
    assert segments.reap() == [ReapedSegment("psm_reused", 4096)]
    assert (shm / "psm_live").exists()


def test_reap_waits_for_recorded_processes_to_exit(
    segments: EngineSegments, shm: Path, holders: list[Holder],
) -> None:
    queue, running = make(shm, "psm_exiting"), make(shm, "psm_running")
    engine, other = Holder("map", queue), Holder("map", running)  # another engine runs on
    holders.extend([engine, other])
    record = segments.record([engine.pid])
    assert record is not None and segments.record([other.pid]) is not None
    engine.let_go()  # it exits on its own: not yet waited for (a zombie holds nothing)
    assert segments.reap(wait_s=60, wait_for=record) == [ReapedSegment("psm_exiting", 4096)]
    assert not queue.exists() and running.exists()


def test_processes_that_hold_no_segment_leave_no_record(
    segments: EngineSegments, holders: list[Holder],
) -> None:
    idle = Holder("open")
    holders.append(idle)
    assert segments.record([idle.pid, 2**22 + 1]) is None
    assert not os.path.exists(segments.root) or os.listdir(segments.root) == []


def test_a_replica_killed_with_its_engine_is_reaped_by_the_sentinel_it_left(
    segments: EngineSegments, shm: Path,
) -> None:
    """As Ray kills a replica: its whole process group at once, the engine and the resource
    tracker in it, so that no process of it reaps anything."""
    queue = make(shm, "psm_killed", 8192)
    stranger = make(shm, "psm_stranger")  # no record names it
    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA, segments.root, str(shm), str(queue), HOLDER],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert replica.stdout is not None and replica.stdout.readline() == "watched\n"
        assert queue.exists()
    finally:
        os.killpg(replica.pid, signal.SIGKILL)
        replica.wait(timeout=30)
    deadline = time.monotonic() + 30
    while queue.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not queue.exists() and os.listdir(segments.root) == []
    assert stranger.exists()
