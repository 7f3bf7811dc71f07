"""Faults at the exact step between two tier calls: one memory tier failing while the other
pins, for a partial load and for a peer's staging. Nothing may stay pinned, and the copies
the tier that answered holds are still served."""

from __future__ import annotations

import errno
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from plane import Plane, make_plane
from scenarios import BLOCK, LAYOUT, blocks, check, held, load, small_config
from writers import StoreLink, during_copy

from cmx.checksum import checksum
from cmx.client import ContextMemory, NamespaceClient
from cmx.client.node_plane import NodePlane
from cmx.doors import Acquire, Request, Unpin
from cmx.errors import UnavailableError
from cmx.keys import Namespace
from cmx.links import Call, LocalLink, actor_name
from cmx.protocol import arena_name
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.tiers import Tier

R = TypeVar("R")
NODE = f"faults-{uuid.uuid4().hex[:6]}"


class StartAllLink(LocalLink):
    """LocalLink with RayLink's ``call_many``: every call is made, then the first failure is
    raised (or, with ``return_exceptions``, kept in its place). ``down`` names actors that
    do not answer."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.down: set[str] = set()

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if name in self.down:
            raise UnavailableError(f"{name} does not answer")
        return super().call(name, request)

    def call_many(self, calls: Sequence[Call], timeout_s: float | None = None,
                  return_exceptions: bool = False) -> list[Any]:
        results: list[Any] = []
        for name, request in calls:
            try:
                results.append(self.call(name, request))
            except Exception as exc:  # noqa: BLE001 - kept, raised after every call ran
                results.append(exc)
        if not return_exceptions:
            for r in results:
                if isinstance(r, Exception):
                    raise r
        return results


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=StartAllLink)
    yield p
    p.close()


def stored(plane: Plane, n: int) -> tuple[list[Any], np.ndarray]:
    keys, payload = blocks(n, seed=3)
    agent = plane.agents[NODE]
    assert agent.store(keys, [None, *keys[:-1]], payload) == n
    assert held(plane, NODE, Tier.DRAM) == (0, 0)
    return keys, payload


def hbm_down(plane: Plane) -> None:
    plane.link.down.add(actor_name(Tier.HBM.value, NODE))  # type: ignore[attr-defined]


def test_partial_load_with_hbm_down_serves_dram_and_leaves_no_pin(plane: Plane) -> None:
    keys, payload = stored(plane, 3)
    hbm_down(plane)
    runs = ((0, 100), (BLOCK // 2, 300))
    got = plane.agents[NODE].read_selection(keys, runs)
    for i, s in enumerate(got):
        assert s is not None and s.source_tier is Tier.DRAM
        block = payload[i * BLOCK : (i + 1) * BLOCK]
        assert bytes(s.data) == bytes(block[0:100]) + bytes(block[BLOCK // 2 : BLOCK // 2 + 300])
    assert held(plane, NODE, Tier.DRAM) == (0, 0)
    check(plane)


def test_stage_with_hbm_down_stages_from_dram_and_leaves_no_stray_pin(plane: Plane) -> None:
    keys, payload = stored(plane, 2)
    hbm_down(plane)
    staged = plane.agents[NODE].stage(keys, "peer-owner")
    assert [s is not None and s.tier is Tier.DRAM for s in staged] == [True, True]
    assert held(plane, NODE, Tier.DRAM) == (2, 0)  # the peer's two pins, nothing more
    plane.agents[NODE].unstage([s for s in staged if s is not None])
    assert held(plane, NODE, Tier.DRAM) == (0, 0)
    check(plane)


@pytest.mark.parametrize("tier", [Tier.DRAM, Tier.HBM])
def test_a_slot_whose_reservation_expired_is_fenced_for_a_lease_period(
    plane: Plane, tier: Tier
) -> None:
    svc = plane.tiers[(NODE, tier)]
    n = svc.info().num_slots
    keys, _ = blocks(n + 1, seed=7)
    slow = svc.reserve([(k, None) for k in keys[:n]], "agent:slow")  # every slot
    plane.clock.advance(plane.config.lease_s + 1)  # the slow writer's leases expire
    assert svc.reserve([(keys[n], None)], "agent:fast") == [None]  # every slot is fenced
    assert svc.stats().fenced_slots == n
    svc.check_integrity()
    assert svc.commit([(g.lease, BLOCK, 0) for g in slow if g is not None]) == 0
    plane.clock.advance(plane.config.lease_s)  # the fence is lifted
    [fast] = svc.reserve([(keys[n], None)], "agent:fast")
    assert fast is not None and svc.stats().fenced_slots == 0
    svc.abort([fast.lease])
    assert svc.stats().fenced_slots == 0  # a holder's abort frees the slot at once
    check(plane)


def test_a_slot_whose_owner_was_released_is_fenced_too(plane: Plane) -> None:
    hbm = plane.tiers[(NODE, Tier.HBM)]
    keys, _ = blocks(2, seed=8)
    hbm.reserve([(keys[0], None)], "client:gone")  # its load may still be filling the slot
    assert hbm.release_owner("client:gone") == 1
    assert hbm.stats().fenced_slots == 1
    check(plane)


def test_a_late_writer_after_its_lease_expired_never_puts_its_bytes_under_another_key(
    plane: Plane,
) -> None:
    agent = plane.agents[NODE]
    keys, payload = blocks(8, seed=5)
    slow = agent.grant_store(keys[:4], [None] * 4, "client:slow")
    plane.clock.advance(plane.config.lease_s + 1)  # the slow writer's leases expire
    fast = agent.grant_store(keys[4:], [None] * 4, "client:fast")
    assert not {g.slot for g in slow if g} & {g.slot for g in fast if g}  # fenced, not reused
    arena = agent.tiers.arena(agent.tiers.current(Tier.DRAM)[0].epoch)
    done = []
    for i, g in enumerate(fast, start=4):
        assert g is not None
        arena.slot_view(g.slot)[:BLOCK] = src = payload[i * BLOCK : (i + 1) * BLOCK]
        done.append((g, BLOCK, checksum(src)))
    for i, g in enumerate(slow):  # the slow writer's copies land late, in its old slots
        assert g is not None
        arena.slot_view(g.slot)[:BLOCK] = payload[i * BLOCK : (i + 1) * BLOCK]
    assert agent.commit_store(keys[4:], [None] * 4, done).committed == 4
    late = agent.commit_store(keys[:4], [None] * 4, [(g, BLOCK, 0) for g in slow if g])
    assert late.committed == 0 and late.refused == tuple(keys[:4])  # the writer learns it
    assert agent.stats().store_commits == {"committed": 4, "refused": 4}
    assert plane.tiers[(NODE, Tier.DRAM)].stats().refused_commits == 4
    data, _ = load(plane, NODE, keys[4:])
    assert bytes(data) == bytes(payload[4 * BLOCK :])
    check(plane)


class AfterAcquire(StartAllLink):
    """StartAllLink that runs ``hook`` once, right after the first ``acquire``: a load that
    holds its HBM grants and has not copied yet."""

    hook: Any = None

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        answer = super().call(name, request)
        if isinstance(request, Acquire) and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return answer


def test_a_load_whose_hbm_grants_expired_before_its_copy_never_lands_on_another_load(
    tmp_path,
) -> None:
    plane = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=AfterAcquire)
    try:
        agent, hbm = plane.agents[NODE], plane.tiers[(NODE, Tier.HBM)]
        keys, payload = blocks(4, seed=9)
        assert agent.store(keys, [None, *keys[:-1]], payload) == 4  # in DRAM, not in HBM
        later: list[Any] = []

        def another_load_meanwhile() -> None:  # the first load is slow past its leases
            plane.clock.advance(plane.config.lease_s + 1)
            later.append(agent.load(keys[2:], plane.lookup(keys[2:])))

        plane.link.hook = another_load_meanwhile  # type: ignore[attr-defined]
        first = agent.load(keys[:2], plane.lookup(keys[:2]))
        assert first.blocks == []  # its grants had ended: its commit is refused, a miss
        [second] = later
        _, arena = agent.tiers.current(Tier.HBM)
        got = b"".join(bytes(arena.slot_view(b.slot)[: b.size]) for b in second.blocks)
        assert got == bytes(payload[2 * BLOCK :])  # the first load's late copies went elsewhere
        assert hbm.stats().fenced_slots == 2 and hbm.stats().refused_commits == 2
        agent.release([b.lease for b in second.blocks])
        check(plane)
    finally:
        plane.close()


def test_a_late_copy_over_a_client_store_fails_the_checksum_taken_of_the_engines_bytes(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plane = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=StoreLink)
    try:
        cm = ContextMemory(plane.config, NODE, owns_ray=False)
        cm.link = plane.link  # type: ignore[assignment]
        cm.plane = NodePlane(plane.link, NODE, 5.0)
        ns = NamespaceClient(cm, Namespace("m", LAYOUT, "t"))
        agent, dram = plane.agents[NODE], plane.tiers[(NODE, Tier.DRAM)]
        keys, payload = blocks(8, seed=6)
        slow = agent.grant_store(keys, [None] * 8, "client:slow")  # DRAM full
        plane.clock.advance(plane.config.lease_s + 1)
        dram.heartbeat()  # the slow writer's leases expire; their slots are fenced
        plane.clock.advance(plane.config.lease_s)  # and the fences run out: a very slow writer

        def slow_copy_lands() -> None:  # in the slot the fast writer just copied into
            [res] = dram._reservations.values()
            i, g = next((i, g) for i, g in enumerate(slow) if g and g.slot == res.slot)
            slot = agent.tiers.arena(g.epoch).slot_view(g.slot)
            slot[:BLOCK] = payload[i * BLOCK : (i + 1) * BLOCK]

        toks = np.random.default_rng(6).integers(0, 50_000, LAYOUT.block_tokens)
        kv = LAYOUT.random_kv(len(toks), seed=6)
        landed = during_copy(monkeypatch, slow_copy_lands)
        ns.store(toks, kv)
        assert landed()
        got = ns.load(toks)
        assert got.shape[3] == 0 or torch.equal(got, kv)  # a miss, never the late bytes
        assert dram.stats().store.quarantined == 1
        check(plane)
    finally:
        plane.close()


class FullDisk(ExtentPlane):
    """The agent's NVMe data plane on a disk that fills: the first extent of a batch is
    written, then ENOSPC."""

    def __init__(self) -> None:
        super().__init__(engine="threads")
        self.failed = 0

    def write_many(self, extents: Sequence[Extent], srcs: Sequence[np.ndarray]
                   ) -> list[tuple[int, bytes]]:
        super().write_many(extents[:1], srcs[:1])
        self.failed += 1
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_that_fills_under_a_demotion_drops_the_victims_and_the_store_goes_on(
    plane: Plane,
) -> None:
    agent = plane.agents[NODE]
    agent.host.nvme.close()
    agent.host.nvme = disk = FullDisk()
    keys, payload = blocks(12, seed=4)
    assert agent.store(keys[:8], [None] * 8, payload[: 8 * BLOCK]) == 8  # DRAM full
    assert agent.store(keys[8:], [None] * 4, payload[8 * BLOCK :]) == 4  # evicts four
    assert disk.failed >= 1
    assert agent.counters.dropped["demotion_failed"] == 4
    nvme = plane.tiers[(NODE, Tier.NVME)]
    assert nvme.contains(keys) == [False] * 12  # nothing half-written is visible
    assert held(plane, NODE, Tier.DRAM) == (0, 0)
    assert nvme.stats().reserved == 0
    data, _ = load(plane, NODE, keys[8:])
    assert bytes(data) == bytes(payload[8 * BLOCK :])
    check(plane)


class HookLink(LocalLink):
    """LocalLink that runs ``after_unpin`` once, right after the first ``unpin`` (call or
    tell): the step between a reader's unpin and what it sends next."""

    after_unpin: Any = None

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        answer = super().call(name, request)
        if isinstance(request, Unpin) and self.after_unpin is not None:
            hook, self.after_unpin = self.after_unpin, None
            hook()
        return answer


def test_a_reader_that_finds_a_copy_corrupt_drops_that_copy_not_its_successor(
    tmp_path,
) -> None:
    plane = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=HookLink)
    try:
        cm = ContextMemory(plane.config, NODE, owns_ray=False)
        cm.link = plane.link  # type: ignore[assignment]
        cm.plane = NodePlane(plane.link, NODE, 5.0)
        ns = NamespaceClient(cm, Namespace("m", LAYOUT, "t"))
        toks = np.random.default_rng(11).integers(0, 50_000, LAYOUT.block_tokens)
        kv = LAYOUT.random_kv(len(toks), seed=11)
        [key] = ns.keys(toks)
        good = torch.cat(LAYOUT.split_blocks(kv)).numpy()
        agent, dram = plane.agents[NODE], plane.tiers[(NODE, Tier.DRAM)]
        assert agent.store([key], [None], good) == 1
        [pin] = dram.pin([key], "test")
        cm.plane.arena(arena_name(Tier.DRAM, NODE, pin.epoch)).slot_view(pin.slot)[7] ^= 0xFF
        dram.unpin([pin.lease])

        def replace_with_a_good_copy() -> None:  # evicted (if still there), stored again
            if dram.contains([key]) == [True]:
                dram.store.delete(key)
            assert agent.store([key], [None], good) == 1

        plane.link.after_unpin = replace_with_a_good_copy  # type: ignore[attr-defined]
        assert ns.load(toks).shape[3] == 0  # the corrupt copy is never used
        assert dram.contains([key]) == [True]  # its intact successor stays
        assert torch.equal(ns.load(toks), kv)
        check(plane)
    finally:
        plane.close()


def test_a_partial_load_that_finds_a_copy_corrupt_drops_that_copy_not_its_successor(
    tmp_path,
) -> None:
    plane = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=HookLink)
    try:
        keys, payload = blocks(1, seed=12)
        agent, dram = plane.agents[NODE], plane.tiers[(NODE, Tier.DRAM)]
        assert agent.store(keys, [None], payload) == 1
        [pin] = dram.pin(keys, "test")
        agent.tiers.arena(pin.epoch).slot_view(pin.slot)[5] ^= 0xFF
        dram.unpin([pin.lease])

        def replace_with_a_good_copy() -> None:  # evicted (if still there), stored again
            if dram.contains(keys) == [True]:
                dram.store.delete(keys[0])
            assert agent.store(keys, [None], payload) == 1

        plane.link.after_unpin = replace_with_a_good_copy  # type: ignore[attr-defined]
        assert agent.read_selection(keys, ((0, 64),)) == [None]  # never the corrupt bytes
        assert dram.contains(keys) == [True]  # its intact successor stays
        [s] = agent.read_selection(keys, ((0, 64),))
        assert s is not None and bytes(s.data) == bytes(payload[:64])
        check(plane)
    finally:
        plane.close()
