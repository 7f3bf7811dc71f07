"""SharedArena and SlotAllocator: alignment, sharing by name, ownership, the free list."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmx.errors import BlockStateError, BlockTooLargeError, StoreClosedError, StoreFullError
from cmx.storage.arena import (
    SHM_DIR,
    SharedArena,
    SlotAllocator,
    SlotRef,
    owner_of,
    read_slot,
    reap_orphans,
)

PREFIX = f"cmx-{os.getpid()}-"


def test_slots_are_page_aligned_and_sized_up_to_4k() -> None:
    with SharedArena.create(capacity_bytes=5 * 8192, slot_bytes=5000) as arena:
        assert arena.slot_bytes == 8192 and arena.num_slots == 5 and arena.owner
        assert arena.buffer.nbytes == 5 * 8192 and arena.buffer.dtype == np.uint8
        for i in range(arena.num_slots):
            view = arena.slot_view(i)
            assert view.ctypes.data % 4096 == 0
            assert view.nbytes == 8192
            assert view.ctypes.data == arena.buffer.ctypes.data + arena.slot_offset(i)
        with pytest.raises(IndexError):
            arena.slot_view(5)


def test_a_slot_view_is_the_arena_not_a_copy() -> None:
    with SharedArena.create(4 * 4096, 4096) as arena:
        arena.slot_view(2)[:3] = [7, 8, 9]
        assert arena.buffer[2 * 4096 : 2 * 4096 + 3].tolist() == [7, 8, 9]
        assert arena.read(2, 3).tolist() == [7, 8, 9]


def test_an_attached_arena_shares_bytes_and_never_unlinks() -> None:
    with SharedArena.create(3 * 4096, 4096) as owner:
        other = SharedArena.attach(owner.name)
        assert (other.slot_bytes, other.num_slots, other.owner) == (4096, 3, False)
        owner.slot_view(1)[:4] = [1, 2, 3, 4]
        assert other.read(1, 4).tolist() == [1, 2, 3, 4]
        other.slot_view(0)[0] = 99
        assert owner.buffer[0] == 99
        other.close()
        assert os.path.exists(os.path.join(SHM_DIR, owner.name))
    assert not os.path.exists(os.path.join(SHM_DIR, owner.name))
    with pytest.raises(FileNotFoundError):
        SharedArena.attach(owner.name)


def test_views_outlive_close_and_unlink() -> None:
    arena = SharedArena.create(2 * 4096, 4096, name=PREFIX + "views")
    view = arena.slot_view(1)
    view[:2] = [5, 6]
    arena.close()
    arena.close()  # idempotent
    arena.unlink()
    arena.unlink()
    assert view[:2].tolist() == [5, 6]  # the mapping lives as long as the view
    with pytest.raises(StoreClosedError):
        arena.slot_view(0)


def test_an_owner_collected_without_unlink_removes_its_file() -> None:
    arena = SharedArena.create(4096, 4096)
    path = os.path.join(SHM_DIR, arena.name)
    assert os.path.exists(path)
    del arena
    gc.collect()
    assert not os.path.exists(path)


def test_bad_arguments_create_nothing() -> None:
    # Each call names its arena, so the check sees this test's names only (other runs on this
    # machine create arenas of their own meanwhile).
    name = PREFIX + "bad"
    with pytest.raises(BlockTooLargeError):
        SharedArena.create(capacity_bytes=4096, slot_bytes=5000, name=name)
    for bad_name in ("a/b", "has:colon", ""):
        with pytest.raises(ValueError):
            SharedArena.create(4096, 4096, name=bad_name)
    for capacity, slot in ((0, 4096), (4096, 0), (4096, -1)):
        with pytest.raises(ValueError):
            SharedArena.create(capacity, slot, name=name)
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert not [n for n in os.listdir(SHM_DIR) if n in ("has:colon", "a")]


def test_a_name_is_not_taken_twice() -> None:
    with SharedArena.create(4096, 4096, name=PREFIX + "twice"):
        with pytest.raises(FileExistsError):
            SharedArena.create(4096, 4096, name=PREFIX + "twice")


def test_attaching_something_else_is_refused() -> None:
    path = os.path.join(SHM_DIR, PREFIX + "stranger")
    with open(path, "wb") as f:
        f.write(b"x" * 8192)
    try:
        with pytest.raises(ValueError, match="not a cmx arena"):
            SharedArena.attach(PREFIX + "stranger")
    finally:
        os.unlink(path)


def test_read_slot_checks_the_reference() -> None:
    with SharedArena.create(2 * 8192, 8192) as arena:
        arena.slot_view(1)[:3] = [1, 2, 3]
        assert read_slot(SlotRef(arena.name, 1, 8192, 3)).tolist() == [1, 2, 3]
        with pytest.raises(ValueError):
            read_slot(SlotRef(arena.name, 1, 4096, 3))
        with pytest.raises(BlockTooLargeError):
            read_slot(SlotRef(arena.name, 1, 8192, 8193))


def test_a_spawned_reader_leaves_the_resource_tracker_quiet() -> None:
    """Python 3.11's tracker warns or unlinks when an attach is tracked; ours is not."""
    script = textwrap.dedent(
        """
        import multiprocessing as mp
        import numpy as np
        from cmx.storage.arena import SharedArena, SlotRef, read_slot

        if __name__ == "__main__":
            arena = SharedArena.create(4 * 8192, 8192)
            data = np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)
            arena.slot_view(3)[:5000] = data
            ref = SlotRef(arena.name, 3, arena.slot_offset(3), 5000)
            with mp.get_context("spawn").Pool(1) as pool:
                got = pool.apply(read_slot, (ref,))
            assert got.tobytes() == data.tobytes()
            assert SharedArena.attach(arena.name).read(3, 5000).tobytes() == data.tobytes()
            arena.close()
            arena.unlink()
            print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    for noise in ("leaked", "Traceback", "KeyError", "Warning"):
        assert noise not in proc.stderr, proc.stderr


def test_the_arenas_of_an_owner_killed_with_its_process_group_are_unlinked() -> None:
    """As Ray kills a worker: its whole process group at once, the resource tracker in it, so
    only the sentinel of the owner's first ``create`` is left to unlink its arenas. Not under
    "cmx-", which any tier starting on this host reaps once their owner is gone."""
    prefix = f"arena-test-{os.getpid()}-killed-"
    script = textwrap.dedent(f"""
        import time
        from cmx.storage.arena import SharedArena
        arenas = [SharedArena.create(4096, 4096, name="{prefix}" + n) for n in ("a", "b")]
        print("made", flush=True)
        time.sleep(120)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    with SharedArena.create(4096, 4096, name=f"{prefix}live") as live:
        try:
            assert owner.stdout is not None and owner.stdout.readline().strip() == "made"
            assert owner_of(f"{prefix}a") == owner.pid
        finally:
            os.killpg(owner.pid, signal.SIGKILL)
            owner.wait()
        deadline = time.monotonic() + 30
        while arenas_named(prefix) != {live.name} and time.monotonic() < deadline:
            time.sleep(0.1)
        left = arenas_named(prefix) - {live.name}
        for name in left:  # so that a failure leaves nothing either
            os.unlink(os.path.join(SHM_DIR, name))
        assert not left and os.path.exists(os.path.join(SHM_DIR, live.name))


def arenas_named(prefix: str) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


# -- the allocator ------------------------------------------------------------------------------


def test_an_attach_may_map_every_page_up_front() -> None:
    with SharedArena.create(4 * 4096, 4096) as arena:
        arena.slot_view(3)[:2] = [5, 6]
        with SharedArena.attach(arena.name, populate=True) as reader:
            assert reader.read(3, 2).tolist() == [5, 6]


def test_orphans_of_dead_owners_are_reaped_and_live_arenas_stay() -> None:
    prefix = f"{PREFIX}reap-"
    script = textwrap.dedent(f"""
        import os
        from multiprocessing import resource_tracker
        from cmx.storage import arena as module, arena_owners
        arena_owners._watched = os.getpid()  # no sentinel: as if it had died with its owner
        arena = module.SharedArena.create(4096, 4096, name="{prefix}orphan")
        resource_tracker.unregister("/{prefix}orphan", "shared_memory")  # the tracker dies too
        os._exit(0)  # killed: nothing unlinks
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    orphan = os.path.join(SHM_DIR, f"{prefix}orphan")
    assert os.path.exists(orphan)
    with open(os.path.join(SHM_DIR, f"{prefix}not-an-arena"), "wb") as f:
        f.write(b"x" * 64)
    try:
        with SharedArena.create(4096, 4096, name=f"{prefix}live") as live:
            assert reap_orphans(prefix, owner=os.getpid()) == []  # another owner's only
            assert reap_orphans(prefix) == [f"{prefix}orphan"]
            assert not os.path.exists(orphan)
            assert os.path.exists(os.path.join(SHM_DIR, live.name))
    finally:
        os.unlink(os.path.join(SHM_DIR, f"{prefix}not-an-arena"))


def test_a_reap_passes_over_what_is_not_a_regular_file(tmp_path) -> None:
    os.mkfifo(tmp_path / "a-fifo")  # an open for reading would wait for a writer for ever
    os.symlink("/dev/zero", tmp_path / "a-link")
    done: list[list[str]] = []
    reader = threading.Thread(target=lambda: done.append(
        reap_orphans("", shm_dir=str(tmp_path), owner=2**22 + 1)), daemon=True)
    reader.start()
    reader.join(10)
    assert done == [[]] and owner_of("a-fifo", str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == ["a-fifo", "a-link"]


def test_a_child_forked_while_the_sentinel_starts_starts_its_own() -> None:
    script = textwrap.dedent("""
        import os, signal, threading, time
        from cmx.storage import arena_owners as arena
        started = []
        def slow(pids, cleanup):  # a sentinel slow to start: its parent holds on meanwhile
            started.append(pids)
            time.sleep(1.0)
            return False
        arena.after_exit = slow
        held, done = threading.Event(), threading.Event()
        def starting():  # a thread of this process starting its sentinel holds the lock
            with arena._watch_lock:
                held.set()
                done.wait(10)
        threading.Thread(target=starting, daemon=True).start()
        held.wait(10)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            arena.watch_owner()
            os._exit(0 if started == [[os.getpid()]] else 3)
        _, status = os.waitpid(pid, 0)
        done.set()
        raise SystemExit(os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == 0


def test_allocator_hands_out_every_slot_once() -> None:
    alloc = SlotAllocator(3)
    slots = [alloc.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and alloc.free == 0 and alloc.used == 3
    with pytest.raises(StoreFullError):
        alloc.alloc()
    alloc.release(1)
    assert alloc.alloc() == 1
    alloc.check_integrity()


def test_allocator_refuses_double_and_foreign_release() -> None:
    alloc = SlotAllocator(2)
    slot = alloc.alloc()
    alloc.release(slot)
    for bad in (slot, 5, -1):
        with pytest.raises(BlockStateError):
            alloc.release(bad)
    alloc.check_integrity()
    assert (alloc.used, alloc.free) == (0, 2)


def test_allocator_integrity_names_the_numbers() -> None:
    alloc = SlotAllocator(64)
    for _ in range(40):
        alloc.alloc()
    alloc._free = alloc._free[:20]  # corrupt: four slots vanish
    with pytest.raises(AssertionError, match="used 40 \\+ free 20 != capacity 64"):
        alloc.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.lists(st.tuples(st.booleans(), st.integers(0, 15)), max_size=80))
def test_allocator_matches_a_set_model(capacity: int, ops: list[tuple[bool, int]]) -> None:
    alloc = SlotAllocator(capacity)
    held: set[int] = set()
    for do_alloc, pick in ops:
        if do_alloc:
            if len(held) == capacity:
                with pytest.raises(StoreFullError):
                    alloc.alloc()
            else:
                slot = alloc.alloc()
                assert slot not in held and 0 <= slot < capacity
                held.add(slot)
        elif held:
            slot = sorted(held)[pick % len(held)]
            alloc.release(slot)
            held.remove(slot)
        else:
            with pytest.raises(BlockStateError):
                alloc.release(pick % capacity)
        alloc.check_integrity()
        assert (alloc.used, alloc.free) == (len(held), capacity - len(held))
