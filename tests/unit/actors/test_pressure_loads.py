"""A prefix eight times larger than this node's HBM and DRAM, held on its NVMe alone, loads
through a few HBM windows at a time: the agent has the NVMe reads of the windows after the one
the client copies out under way before that copy (``cmx.client.loads.load_depth`` windows hold
pins at once), the bytes come back exact, a window that comes back corrupt ends the load there, and
every pin of every window is given back. The blocks its windows evict from HBM stay on NVMe,
not copied to DRAM, in three round trips to the tiers a window; a block NVMe lacks still goes
to DRAM."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from plane import Plane, make_plane
from scenarios import BLOCK, LAYOUT, Sent, check, held, small_config

from cmx.buffers import align_up
from cmx.client import ContextMemory, NamespaceClient
from cmx.client.loads import load_depth, load_window
from cmx.client.node_plane import NodePlane
from cmx.doors import Load, Pending, Release, Request
from cmx.keys import Namespace
from cmx.links import Call, LocalLink, actor_name
from cmx.storage.arena import SharedArena
from cmx.tiers import Tier

R = TypeVar("R")
NODE = f"pressure-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens
TIER_BLOCKS = 8  # HBM and DRAM each
BLOCKS = 8 * TIER_BLOCKS  # the prefix: eight times either memory tier


class Events:
    """What the agent and the client did, in order: "read N" (the agent's NVMe reads of one
    window, N blocks), "copy" (the client starts copying a window out of HBM), "release",
    "give_up"."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def reads_before_each_copy(self) -> list[int]:
        out, reads = [], 0
        for e in self.seen:
            if e.startswith("read"):
                reads += 1
            elif e == "copy":
                out.append(reads)
        return out


class RecordingLink(LocalLink):
    """Runs calls in this process as LocalLink does, noting the client's releases and
    give-ups, and each round trip to this node's tiers (``trips``: the calls of one
    ``call_many``, as "tier.method"); ``on_load[n]`` runs on the answer of the n-th load
    before the client sees it."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.events = Events()
        self.on_load: dict[int, Callable[[Any], Any]] = {}
        self.loads = 0
        self.trips: list[tuple[str, ...]] = []
        self._tiers = {actor_name(t.value, NODE): t.value for t in Tier if t is not Tier.POOL}

    def call_many(self, calls: Sequence[Call], timeout_s: float | None = None,
                  return_exceptions: bool = False) -> list[Any]:
        trip = tuple(f"{self._tiers[n]}.{r.method}" for n, r in calls if n in self._tiers)
        if trip:
            self.trips.append(trip)
        return super().call_many(calls, timeout_s, return_exceptions)

    def submit(self, name: str, request: Request[R]) -> Pending[R]:
        if isinstance(request, Release):
            self.events.seen.append(request.method)
        answer = super().submit(name, request)
        if isinstance(request, Load):
            hook = self.on_load.get(self.loads)
            self.loads += 1
            if hook is not None:  # on the answer LocalLink keeps in the Pending's ref
                answer = Pending(request, hook(answer.ref))
        return answer

    def tell(self, name: str, request: Request[Any]) -> None:
        self.events.seen.append(request.method)
        super().tell(name, request)


class RecordingPlane(NodePlane):
    """The client's view of this node's arenas, noting each window's copy out as it starts."""

    def __init__(self, link: Any, node: str, events: Events) -> None:
        super().__init__(link, node, 5.0)
        self.events = events

    def arena(self, name: str) -> SharedArena:
        self.events.seen.append("copy")
        return super().arena(name)


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    config = small_config(tmp_path, placement="write_through", hbm_bytes=TIER_BLOCKS * BLOCK,
                          dram_bytes=TIER_BLOCKS * BLOCK, nvme_bytes=4 * BLOCKS * BLOCK)
    p = make_plane(config, nodes=(NODE,), link_type=RecordingLink)
    yield p
    p.close()


def on_nvme_only(plane: Plane) -> tuple[NamespaceClient, Any, torch.Tensor]:
    """A client, and the prefix it stored (window by window: DRAM holds an eighth of it),
    now held on this node's NVMe alone; the agent's NVMe reads noted from here on."""
    link: RecordingLink = plane.link  # type: ignore[assignment]
    cm = ContextMemory(plane.config, NODE, owns_ray=False)
    cm.link = link  # type: ignore[assignment]
    cm.plane = RecordingPlane(link, NODE, link.events)
    ns = NamespaceClient(cm, Namespace("m", LAYOUT, "pressure"))
    toks = np.random.default_rng(7).integers(0, 50_000, BLOCKS * T)
    kv = LAYOUT.random_kv(len(toks), seed=7)
    per = TIER_BLOCKS // 2
    for first in range(0, BLOCKS, per):
        stop = (first + per) * T
        assert ns.store(toks[:stop], kv[:, :, :, first * T : stop], start=first * T).wait() == per
    keys = ns.keys(toks)
    for tier in (Tier.HBM, Tier.DRAM):
        plane.tiers[(NODE, tier)].evict(keys)
    assert all(c.tier is Tier.NVME for b in ns.lookup(toks).blocks for c in b.copies)
    host = plane.agents[NODE].host
    read_extents = host.read_extents

    def noted(extents: Any, grants: Any, priority: Any) -> list[bool]:
        link.events.seen.append(f"read {len(extents)}")
        return read_extents(extents, grants, priority)

    host.read_extents = noted  # type: ignore[method-assign]
    link.events.seen.clear()
    return ns, toks, kv


def nothing_held(plane: Plane) -> bool:
    return all(held(plane, NODE, t) == (0, 0) for t in (Tier.HBM, Tier.DRAM, Tier.NVME))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_windows_after_the_one_copied_out_are_read_from_nvme_before_its_copy(
        plane: Plane) -> None:
    """Before the client copies window k out of HBM, the agent has read windows k+1 to
    k+depth-1 from NVMe (as far as the prefix goes), at least one of them: the disk is not
    left waiting for the copy, nor for the client to ask for the next window after it."""
    ns, toks, kv = on_nvme_only(plane)
    link: RecordingLink = plane.link  # type: ignore[assignment]
    window = load_window(plane.config)
    windows = BLOCKS // window
    got = ns.load(toks)
    assert same_bits(got, kv)
    reads = [e for e in link.events.seen if e.startswith("read")]
    assert reads == [f"read {window}"] * windows  # every block read from NVMe, window by window
    before = link.events.reads_before_each_copy()
    assert len(before) == windows
    assert all(n >= min(k + 2, windows) for k, n in enumerate(before)), before
    assert before == [min(k + load_depth(plane.config), windows) for k in range(windows)]
    assert nothing_held(plane)
    check(plane)


def test_a_prefix_eight_times_the_memory_tiers_loads_back_exact_twice(plane: Plane) -> None:
    """Loaded twice (the second time from what the first left in HBM, and NVMe for the
    rest), the prefix comes back exact both times, with nothing held after either."""
    ns, toks, kv = on_nvme_only(plane)
    assert same_bits(ns.load(toks), kv)
    assert nothing_held(plane)
    assert same_bits(ns.load(toks), kv)
    assert nothing_held(plane)
    check(plane)


def test_a_corrupt_window_mid_prefix_ends_the_load_there_with_every_pin_given_back(
        plane: Plane) -> None:
    """A block of the sixth window goes bad in HBM after the agent verified it, while the
    windows after it are already asked for: the load returns the blocks before it exact,
    gives up every window asked ahead, and the bad copy is quarantined."""
    ns, toks, kv = on_nvme_only(plane)
    link: RecordingLink = plane.link  # type: ignore[assignment]
    hbm = plane.tiers[(NODE, Tier.HBM)]
    window = load_window(plane.config)
    bad_window = 5

    def corrupt_first(answer: Any) -> Any:
        hbm.store.arena.slot_view(answer.value.blocks[0].slot)[5] ^= 0xFF
        return answer

    link.on_load[bad_window] = corrupt_first
    got = ns.load(toks)
    good = bad_window * window
    assert same_bits(got, kv[:, :, :, : good * T])
    depth = load_depth(plane.config)
    assert link.events.seen.count("give_up") == depth - 1  # the windows asked after it
    assert link.loads == bad_window + depth  # nothing asked once it came back corrupt
    assert nothing_held(plane)
    assert hbm.stats().store.quarantined == 1
    check(plane)



def test_a_scan_demotes_to_dram_nothing_nvme_holds_in_three_tier_round_trips_a_window(
        plane: Plane) -> None:
    """The prefix is more than HBM and DRAM hold together: the blocks its windows evict from
    HBM stay on NVMe and are not copied to DRAM (where the scan would evict them in turn), so
    DRAM gains none of them, and each window asks this node's tiers three times (HBM's slots
    with NVMe's pins, which victims are held below, the commit), twice while HBM has room."""
    ns, toks, kv = on_nvme_only(plane)
    link: RecordingLink = plane.link  # type: ignore[assignment]
    agent = plane.agents[NODE]
    window = load_window(plane.config)
    windows, with_room = BLOCKS // window, TIER_BLOCKS // window
    link.trips.clear()
    assert same_bits(ns.load(toks), kv)
    assert agent.counters.dropped["scan_held_on_nvme"] == BLOCKS - TIER_BLOCKS
    assert "hbm->dram" not in agent.stats().moved_bytes
    keys = ns.keys(toks)
    assert not any(plane.tiers[(NODE, Tier.DRAM)].contains(keys))
    assert all(plane.tiers[(NODE, Tier.NVME)].contains(keys))
    loads = Counter(t for t in link.trips if t != ("hbm.unpin",))  # the releases aside
    assert loads == {("hbm.acquire", "nvme.pin"): windows, ("hbm.commit_pinned",): windows,
                     ("dram.contains", "nvme.contains"): windows - with_room}
    assert nothing_held(plane)
    check(plane)


def test_a_scans_windows_staged_in_hbm_are_never_published(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan's windows pass through HBM for the client alone, evicted by the same scan
    moments later: the HBM tier sends the directory nothing of them (each would cost the
    tier and a shard a batch per window), while every block stays listed on NVMe."""
    ns, toks, kv = on_nvme_only(plane)
    sent = Sent(plane, monkeypatch)
    keys = set(ns.keys(toks))
    assert same_bits(ns.load(toks), kv)
    plane.tiers[(NODE, Tier.HBM)].publisher.flush(heartbeat=True)
    assert [e for e in sent.entries if e[0] in keys] == []
    assert all({c.tier for c in b.copies} == {Tier.NVME} for b in ns.lookup(toks).blocks)
    assert nothing_held(plane)
    check(plane)


def test_a_block_a_scan_evicts_from_hbm_that_nvme_lacks_is_demoted_to_dram(
        plane: Plane) -> None:
    """A block held in HBM alone when a scan starts is evicted by it and demoted to DRAM as
    by any load (only blocks NVMe holds are left to NVMe): it loads back exact after."""
    ns, toks, kv = on_nvme_only(plane)
    agent = plane.agents[NODE]
    hot = NamespaceClient(ns.cm, Namespace("m", LAYOUT, "hot"))
    hot_toks = np.random.default_rng(8).integers(0, 50_000, T)
    hot_kv = LAYOUT.random_kv(T, seed=8)
    assert hot.store(hot_toks, hot_kv).wait() == 1
    hot_keys = hot.keys(hot_toks)
    assert agent.prefetch(hot_keys, plane.lookup(hot_keys)) == 1
    for tier in (Tier.DRAM, Tier.NVME):
        plane.tiers[(NODE, tier)].evict(hot_keys)
    assert [c.tier for b in hot.lookup(hot_toks).blocks for c in b.copies] == [Tier.HBM]
    assert same_bits(ns.load(toks), kv)
    assert plane.tiers[(NODE, Tier.HBM)].contains(hot_keys) == [False]
    assert plane.tiers[(NODE, Tier.DRAM)].contains(hot_keys) == [True]
    assert agent.stats().moved_bytes["hbm->dram"] == BLOCK
    assert agent.counters.dropped["scan_held_on_nvme"] == BLOCKS - TIER_BLOCKS
    assert same_bits(hot.load(hot_toks), hot_kv)
    assert nothing_held(plane)
    check(plane)


@pytest.mark.parametrize("block,hbm", [(6000, 24_000), (8192, 8192), (8192, 3 * 8192),
                                       (2 << 20, 64 << 20), (2 << 20, 1 << 30),
                                       (512 << 20, 1 << 30)])
def test_a_loads_windows_in_flight_fit_the_hbm_arena(tmp_path, block: int, hbm: int) -> None:
    """Counted in the arena's slots (a block rounded up to the page), never more blocks in
    flight than HBM holds, and at least one."""
    config = small_config(tmp_path, block_bytes=block, hbm_bytes=hbm)
    slots = hbm // align_up(block)  # as ``SharedArena.create`` makes them
    window, depth = load_window(config), load_depth(config)
    assert 1 <= window * depth <= slots
