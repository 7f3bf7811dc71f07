"""How an agent reaches its host's bytes: over NIXL from another process (a DPU's), exactly as
the local access does by mapping the arenas and opening the files; and a process that plays a
DPU cannot map a host arena or open a host file at all.

The host endpoint runs in a child process (real NIXL: UCX between the processes, POSIX for
the files); this process is the DPU side.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cmx.actors.dpu.access import (
    HostAccess,
    HostAccessForbidden,
    HostPeer,
    HostRegion,
    LocalAccess,
)
from cmx.actors.dpu.nixl_access import NixlAccess
from cmx.actors.tiers.arena import ArenaInfo
from cmx.actors.transport.base import TransferError
from cmx.checksum import checksum
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Tier

SLOT = 4 << 20


def _serve(conn: Any, name: str = "test-host-endpoint") -> None:
    from cmx.actors.dpu.host import HostEndpoint

    endpoint = HostEndpoint(name)
    while True:
        method, args = conn.recv()
        if method == "stop":
            return
        try:
            conn.send(getattr(endpoint, method)(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the caller to raise
            conn.send(exc)


class PipeEndpoint:
    """The host endpoint in a child process, called over a pipe (a Ray actor in the service)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def _call(self, method: str, *args: object) -> Any:
        try:
            self.conn.send((method, args))
            answer = self.conn.recv()
        except (EOFError, OSError) as exc:  # the endpoint's process is gone, as Ray says it
            raise TransferError(f"host endpoint: {exc!r}") from exc
        if isinstance(answer, Exception):
            raise answer
        return answer

    def peer(self) -> HostPeer:
        return self._call("peer")  # type: ignore[no-any-return]

    def attach(self, info: ArenaInfo) -> HostRegion:
        return self._call("attach", info)  # type: ignore[no-any-return]

    def read_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._call("read_extent", extent, arena, slot)

    def write_extent(self, extent: Extent, arena: str, slot: int) -> None:
        self._call("write_extent", extent, arena, slot)

    def move_extents(self, pairs: list[tuple[Extent, Extent]]) -> list[bool | None]:
        return self._call("move_extents", pairs)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def host() -> Iterator[tuple[SharedArena, SharedArena, PipeEndpoint]]:
    dram, hbm = SharedArena.create(8 * SLOT, SLOT), SharedArena.create(8 * SLOT, SLOT)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    try:
        yield dram, hbm, PipeEndpoint(parent)
    finally:
        parent.send(("stop", ()))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        for arena in (dram, hbm):
            arena.close()
            arena.unlink()


def _infos(dram: SharedArena, hbm: SharedArena) -> list[ArenaInfo]:
    return [ArenaInfo(tier, "node", a.name, SLOT, 8, True, f"epoch-{tier.value}")
            for tier, a in ((Tier.DRAM, dram), (Tier.HBM, hbm))]


def _segment(tmp_path: Path) -> str:
    path = tmp_path / "segment"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4 * SLOT)
    os.close(fd)
    return str(path)


def _scenario(access: HostAccess, dram: SharedArena, hbm: SharedArena, tmp_path: Path) -> None:
    """Every move of the interface; the bytes checked in the host's own arenas."""
    rng = np.random.default_rng(7)
    block = rng.integers(0, 256, SLOT, dtype=np.uint8)
    for info in _infos(dram, hbm):
        access.attach(info)
    access.write(dram.name, 2, block)
    assert np.array_equal(dram.slot_view(2), block)
    assert np.array_equal(access.read(dram.name, 2, SLOT), block)
    access.copy((dram.name, 2), (hbm.name, 5), SLOT - 100)
    assert np.array_equal(hbm.slot_view(5)[: SLOT - 100], block[: SLOT - 100])
    extent = Extent(b"k" * 32, _segment(tmp_path), 2 * 4096, SLOT - 4096,
                    checksum(block[: SLOT - 4096]))
    access.write_extent(extent, dram.name, 2)
    access.read_extent(extent, hbm.name, 6)
    assert np.array_equal(hbm.slot_view(6)[: extent.size], block[: extent.size])


def test_the_nixl_access_moves_exact_bytes_with_no_view_of_host_memory(
    host: tuple[SharedArena, SharedArena, PipeEndpoint], tmp_path: Path,
) -> None:
    dram, hbm, endpoint = host
    access = NixlAccess("test-dpu-agent", endpoint, bounce_bytes=3 << 20)  # windows: 3+1 MiB
    try:
        _scenario(access, dram, hbm, tmp_path)
        # A read and a copy's read; a write and a copy's write: every byte over NIXL.
        assert access.bytes_read == access.bytes_written == 2 * SLOT - 100
        with pytest.raises(HostAccessForbidden):
            access.view(dram.name, 2)
        assert not hasattr(access, "nvme") and not hasattr(access, "_arenas")
    finally:
        access.close()


def test_the_local_access_does_the_same_through_shared_memory_and_files(
    host: tuple[SharedArena, SharedArena, PipeEndpoint], tmp_path: Path,
) -> None:
    dram, hbm, _ = host
    access = LocalAccess()
    try:
        _scenario(access, dram, hbm, tmp_path)
    finally:
        access.close()


def _play_dpu(name: str, path: str, conn: Any) -> None:
    from cmx.actors.dpu.access import forbid_host_access
    from cmx.storage.nvme.dataplane import ExtentPlane

    forbid_host_access()
    found = []
    for attempt in (lambda: SharedArena.attach(name),
                    lambda: ExtentPlane().read_many([Extent(b"k" * 32, path, 0, 4096)],
                                                    [np.zeros(4096, np.uint8)])):
        try:
            attempt()
            found.append("allowed")
        except HostAccessForbidden:
            found.append("forbidden")
    conn.send(found)


def test_a_process_playing_a_dpu_cannot_map_host_memory_or_open_host_files(
    host: tuple[SharedArena, SharedArena, PipeEndpoint], tmp_path: Path,
) -> None:
    dram, _, _ = host
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_play_dpu, args=(dram.name, _segment(tmp_path), child))
    proc.start()
    assert parent.poll(120)
    assert parent.recv() == ["forbidden", "forbidden"]
    proc.join(30)


def test_an_unattached_arena_is_a_typed_error_not_a_stray_address(
    host: tuple[SharedArena, SharedArena, PipeEndpoint],
) -> None:
    from cmx.actors.transport.base import TransferError

    dram, _, endpoint = host
    access = NixlAccess("test-dpu-agent-2", endpoint, bounce_bytes=1 << 20)
    with pytest.raises(TransferError):
        access.read("cmx-no-such-arena", 0, 16)
    access.attach(_infos(dram, dram)[0])
    with pytest.raises(ValueError):
        access.read(dram.name, 8, 16)  # slot 8 of 8
    access.close()


def test_a_restarted_host_tier_retires_its_earlier_arena_on_both_sides(
    host: tuple[SharedArena, SharedArena, PipeEndpoint],
) -> None:
    from cmx.actors.dpu.access import HostArenaRetired

    _, hbm, endpoint = host
    first = SharedArena.create(4 * SLOT, SLOT)
    second = SharedArena.create(4 * SLOT, SLOT)
    access = NixlAccess("test-dpu-agent-3", endpoint, bounce_bytes=1 << 20)
    block = np.random.default_rng(9).integers(0, 256, SLOT, dtype=np.uint8)
    try:
        access.attach(ArenaInfo(Tier.HBM, "node", hbm.name, SLOT, 8, True, "epoch-hbm"))
        access.attach(ArenaInfo(Tier.DRAM, "node", first.name, SLOT, 4, False, "epoch-1"))
        access.write(first.name, 1, block)  # step one, in the first incarnation
        # The DRAM tier restarts: a new arena, and the agent attaches it.
        access.attach(ArenaInfo(Tier.DRAM, "node", second.name, SLOT, 4, False, "epoch-2"))
        first.slot_view(1)[:] = 0
        with pytest.raises(HostArenaRetired):  # step two: nothing lands in the first
            access.write(first.name, 1, block)
        assert not first.slot_view(1).any()
        assert {r.arena for r in endpoint.peer().regions} == {hbm.name, second.name}
        access.write(second.name, 1, block)
        access.copy((second.name, 1), (hbm.name, 3), SLOT)  # the other tier is untouched
        assert np.array_equal(hbm.slot_view(3), block)
        assert np.array_equal(access.read(second.name, 1, SLOT), block)
    finally:
        access.close()
        for arena in (first, second):
            arena.close()
            arena.unlink()


def test_moves_through_several_bounce_buffers_at_once_keep_every_byte(
    host: tuple[SharedArena, SharedArena, PipeEndpoint],
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    dram, hbm, endpoint = host
    access = NixlAccess("test-dpu-agent-4", endpoint, bounce_bytes=1 << 20, buffers=3)
    rng = np.random.default_rng(11)
    data = [rng.integers(0, 256, SLOT, dtype=np.uint8) for _ in range(8)]
    try:
        for info in _infos(dram, hbm):
            access.attach(info)

        def round_trip(i: int) -> bool:  # each slot through its own buffer, 4 windows each
            access.write(dram.name, i, data[i])
            access.copy((dram.name, i), (hbm.name, i), SLOT)
            return bool(np.array_equal(access.read(hbm.name, i, SLOT), data[i]))

        with access.bounce.take(), access.bounce.take():  # two held: the third still moves
            assert round_trip(0)
        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(round_trip, range(8)))
        for i in range(8):
            assert np.array_equal(hbm.slot_view(i), data[i])
        assert access.bounce.peak <= 3
    finally:
        access.close()


class RestartingEndpoint(PipeEndpoint):
    """The endpoint in a child process that can die and come back under its name, as Ray
    restarts the endpoint's actor in place: the same handle, none of its registrations."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: Any = None
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, self.name), daemon=True)
        self.proc.start()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", ()))
            self.proc.join(30)


def test_an_endpoint_that_restarts_gets_every_arena_back_and_the_move_is_made_again() -> None:
    dram, hbm = SharedArena.create(8 * SLOT, SLOT), SharedArena.create(8 * SLOT, SLOT)
    endpoint = RestartingEndpoint("test-host-endpoint-restarts")
    access = NixlAccess("test-dpu-agent-5", endpoint, bounce_bytes=1 << 20, timeout_s=20)
    block = np.random.default_rng(13).integers(0, 256, SLOT, dtype=np.uint8)
    try:
        for info in _infos(dram, hbm):
            access.attach(info)
        access.write(dram.name, 1, block)
        endpoint.kill()  # between two moves: the registrations die with the process
        endpoint.start()
        access.copy((dram.name, 1), (hbm.name, 2), SLOT)  # fails once, then made again
        assert np.array_equal(hbm.slot_view(2), block)
        assert np.array_equal(access.read(hbm.name, 2, SLOT), block)
        assert {r.arena for r in endpoint.peer().regions} == {dram.name, hbm.name}
        endpoint.kill()  # and now it stays down: a typed error, within the bound
        with pytest.raises(TransferError):
            access.read(dram.name, 1, SLOT)
    finally:
        access.close()
        endpoint.stop()
        for arena in (dram, hbm):
            arena.close()
            arena.unlink()
