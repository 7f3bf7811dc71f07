"""Faults in the middle of an overlapped write-through store: the DRAM tier restarting
between a window's commit and its write-through, two writers storing the same blocks at once,
a commit the writer stopped waiting for, an agent that dies holding a window's pins; and the
checksums of blocks copied from a strided KV, checked by whole and by one-layer loads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from plane import Plane
from scenarios import LAYOUT, LEASE_S, check, held, restart_tier
from test_store_overlap import (
    NODE,
    Deferred,
    InterleavingLink,
    T,
    client,
    kv_of,
    nothing_held,
    plane_of,
    same_bits,
)

from cmx.checksum import checksum
from cmx.client import NamespaceClient
from cmx.doors import Pending
from cmx.errors import UnavailableError
from cmx.selection import Selection
from cmx.tiers import Tier


@pytest.fixture
def tiny(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    """DRAM of one block: window k+1 has room only once window k is written through."""
    p = plane_of(tmp_path, monkeypatch, dram_blocks=1)
    yield p
    p.close()


@pytest.fixture
def plane(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    """DRAM of eight blocks: windows of four."""
    p = plane_of(tmp_path, monkeypatch, dram_blocks=8)
    yield p
    p.close()


def test_a_dram_restart_between_a_windows_commit_and_its_write_through_loses_nothing(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first window's pins name the old incarnation: its write-through reads the old
    arena (still mapped), whose bytes match; the later windows go to the new one."""
    link: InterleavingLink = plane.link  # type: ignore[assignment]
    after = link.after_dram_commit
    restarted: list[bool] = []

    def restart_then_grant() -> None:
        if not restarted:
            restarted.append(True)
            restart_tier(plane, NODE, Tier.DRAM)
        after()

    monkeypatch.setattr(link, "after_dram_commit", restart_then_grant)
    ns = client(plane)
    toks, kv = kv_of(12, seed=11)
    handle = ns.store(toks, kv)
    assert handle.wait() == 12 and handle.refused == ()
    keys = ns.keys(toks)
    assert plane.tiers[(NODE, Tier.NVME)].contains(keys) == [True] * 12
    plane.tiers[(NODE, Tier.DRAM)].evict(keys)
    assert same_bits(ns.load(toks), kv)
    assert nothing_held(plane)
    check(plane)


def test_two_writers_storing_the_same_blocks_at_once_store_each_once(plane: Plane) -> None:
    a, b = client(plane), client(plane)
    toks, kv = kv_of(12, seed=12)
    first = a.store(toks, kv)
    second = b.store(toks, kv)
    link: InterleavingLink = plane.link  # type: ignore[assignment]
    link.flush()
    # The second writer's blocks are in DRAM again (the first's were evicted by its later
    # windows) and already on NVMe: written once there, nothing refused, nothing left held.
    assert first.wait() == 12 and first.refused == () and second.refused == ()
    keys = a.keys(toks)
    assert plane.tiers[(NODE, Tier.NVME)].contains(keys) == [True] * 12
    plane.tiers[(NODE, Tier.DRAM)].evict(keys)
    assert same_bits(b.load(toks), kv)
    assert nothing_held(plane)
    check(plane)


def test_a_commit_the_writer_stops_waiting_for_is_not_committed_twice_nor_left_pinned(
    tiny: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Window 2's grant comes back short (window 1's pinned block fills DRAM); waiting for
    window 1's commit times out in the writer while the agent finishes it: the store raises,
    asks no grant again, and window 1 stays committed once, written through, unpinned."""
    link: InterleavingLink = tiny.link  # type: ignore[assignment]
    result = link.result
    timed_out: list[bool] = []

    def times_out_once(pending: Pending[Any], timeout_s: float | None = None) -> Any:
        if isinstance(pending.ref, Deferred) and not timed_out:
            timed_out.append(True)
            raise UnavailableError("a call did not answer: timed out")
        return result(pending, timeout_s)

    monkeypatch.setattr(link, "result", times_out_once)
    ns = client(tiny)
    toks, kv = kv_of(3, seed=13)
    with pytest.raises(UnavailableError):
        ns.store(toks, kv)
    link.flush()
    assert link.events == ["grant", "commit", "grant"]  # window 2 is never asked again
    keys = ns.keys(toks)
    assert tiny.tiers[(NODE, Tier.NVME)].contains(keys) == [True, False, False]
    assert tiny.agents[NODE].stats().store_commits == {"committed": 1, "refused": 0}
    assert nothing_held(tiny)
    check(tiny)
    assert ns.store(toks, kv).wait() == 2  # the rest: the first is in DRAM still
    assert tiny.tiers[(NODE, Tier.NVME)].contains(keys) == [True] * 3
    assert same_bits(ns.load(toks), kv)
    assert nothing_held(tiny)
    check(tiny)


def test_the_pins_of_a_window_whose_agent_died_expire_with_their_leases(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent dies after committing a window, before its write-through: nothing gives
    its pins back, and they end when their leases do; the blocks stay committed in DRAM."""
    agent = plane.agents[NODE]

    def dies(*args: Any) -> Any:
        raise SystemExit("agent killed")

    monkeypatch.setattr(agent.stores, "place_committed", dies)
    monkeypatch.setattr(agent.tiers, "give_back", lambda *args, **kwargs: None)  # never sent
    ns = client(plane)
    toks, kv = kv_of(4, seed=14)
    with pytest.raises(SystemExit):
        ns.store(toks, kv).wait()
    dram = plane.tiers[(NODE, Tier.DRAM)]
    assert held(plane, NODE, Tier.DRAM) == (4, 0)
    plane.clock.advance(LEASE_S + 1)
    dram.heartbeat()
    assert held(plane, NODE, Tier.DRAM) == (0, 0)
    assert dram.contains(ns.keys(toks)) == [True] * 4
    assert same_bits(ns.load(toks), kv)
    check(plane)


@pytest.mark.parametrize("strides", ["window", "token_minor"])
def test_blocks_copied_from_a_strided_kv_verify_in_whole_and_partial_loads(
    plane: Plane, strides: str
) -> None:
    """Each block's checksum is the writer's, of the gathered source: whole and one-layer
    loads check it (from DRAM, then from NVMe) and get exactly the KV stored."""
    ns = client(plane)
    toks, wide = kv_of(13, seed=15)
    kv = wide[:, :, :, T : 13 * T]  # an engine's window: strided per block
    if strides == "token_minor":
        kv = kv.transpose(3, 4).contiguous().transpose(3, 4)
    toks = toks[T:]
    assert not kv.is_contiguous()
    assert ns.store(toks, kv).wait() == 12
    for _ in ("dram", "nvme"):
        assert same_bits(ns.load(toks), kv)
        assert same_bits(one_layer(plane, ns, toks), kv[1:2])
        assert nothing_held(plane)
        plane.tiers[(NODE, Tier.DRAM)].evict(ns.keys(toks))
    check(plane)


def one_layer(plane: Plane, ns: NamespaceClient, toks: Any) -> torch.Tensor:
    """Layer 1 of each block as a partial load gathers it (the agent's ``load_slices``),
    each block's selection checked against its source's checksum as the client checks it."""
    selection = Selection.of(LAYOUT, 1, None)
    blocks = list(ns.lookup(toks).blocks)
    got = plane.agents[NODE].load_slices([b.key for b in blocks],
                                         [list(b.copies) for b in blocks],
                                         selection.runs(LAYOUT))
    assert len(got) == len(blocks)
    assert all(checksum(b.data) == b.checksum for b in got)
    return torch.cat([selection.to_tensor(LAYOUT, b.data) for b in got], dim=3)
