"""Stores and loads that stream through a tier window by window. A store larger than DRAM
commits (and writes through) each window before the next; a prefix this node holds only on
NVMe loads through its agent with the next window asked for while this one is copied out.
The bytes come back exact, and a window that fails or comes back corrupt ends the load with
every pin of every window given back."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from plane import Plane, make_plane
from scenarios import BLOCK, LAYOUT, check, held, small_config

from cmx.client import ContextMemory, NamespaceClient
from cmx.client.loads import load_window
from cmx.client.node_plane import NodePlane
from cmx.doors import Load, Pending, Release, Request
from cmx.errors import UnavailableError
from cmx.keys import Namespace
from cmx.links import LocalLink
from cmx.tiers import Tier

NODE = f"pipe-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens
R = TypeVar("R")
BLOCKS = 6  # three windows: HBM holds 4 blocks, a window is half of it (2), two at once


class ScriptedLink(LocalLink):
    """Keeps the order in which the client sends the agent's loads and releases. A release
    runs when the client waits for it, or else only after the next load has run, as a Ray
    actor serving calls concurrently may run them (``flush`` runs what is left).
    ``on_load[n]`` runs on the answer of the n-th load (0-based) before the client sees it,
    and may replace it."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.events: list[str] = []
        self.on_load: dict[int, Callable[[Any], Any]] = {}
        self._loads = 0
        self._late: list[Late] = []

    def submit(self, name: str, request: Request[R]) -> Pending[R]:
        if isinstance(request, Release):
            self.events.append(request.method)
            late = Late(lambda: LocalLink.submit(self, name, request))
            self._late.append(late)
            return Pending(request, late)
        answer = super().submit(name, request)
        if isinstance(request, Load):
            self.events.append(f"load {self._loads}")
            hook = self.on_load.get(self._loads)
            self._loads += 1
            if hook is not None:  # on the answer LocalLink keeps in the Pending's ref
                answer = Pending(request, hook(answer.ref))
            self.flush()
        return answer

    def result(self, pending: Pending[R], timeout_s: float | None = None) -> R:
        if isinstance(pending.ref, Late):
            pending = pending.ref.run()
        return super().result(pending, timeout_s)

    def tell(self, name: str, request: Request[Any]) -> None:
        self.events.append(request.method)
        super().tell(name, request)

    def flush(self) -> None:
        for late in self._late:
            late.run()
        self._late.clear()


class Late:
    """A call sent and not yet run."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call = call
        self._answer: Any = None

    def run(self) -> Any:
        if self._answer is None:
            self._answer = self._call()
        return self._answer


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path, placement="write_through", hbm_bytes=4 * BLOCK),
                   nodes=(NODE,), link_type=ScriptedLink)
    yield p
    p.close()


def on_nvme_only(plane: Plane, n: int, seed: int) -> tuple[NamespaceClient, Any, torch.Tensor]:
    """A client, and ``n`` blocks it stored that this node now holds on NVMe alone."""
    cm = ContextMemory(plane.config, NODE, owns_ray=False)
    cm.link = plane.link  # type: ignore[assignment]
    cm.plane = NodePlane(plane.link, NODE, 5.0)
    ns = NamespaceClient(cm, Namespace("m", LAYOUT, "pipe"))
    toks = np.random.default_rng(seed).integers(0, 50_000, n * T)
    kv = LAYOUT.random_kv(len(toks), seed=seed)
    assert ns.store(toks, kv).wait() == n
    keys = ns.keys(toks)
    for tier in (Tier.HBM, Tier.DRAM):
        plane.tiers[(NODE, tier)].evict(keys)
    assert all(c.tier is Tier.NVME for b in ns.lookup(toks).blocks for c in b.copies)
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    link.events.clear()
    return ns, toks, kv


def nothing_held(plane: Plane) -> bool:
    """Nothing pinned or reserved, once every release sent has run."""
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    link.flush()
    return all(held(plane, NODE, t) == (0, 0) for t in (Tier.HBM, Tier.DRAM, Tier.NVME))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_store_larger_than_dram_commits_window_by_window_exact(plane: Plane) -> None:
    """20 blocks through a DRAM of 8 (windows of 4): every block reaches NVMe
    (write-through) and loads back exact."""
    ns, toks, kv = on_nvme_only(plane, 20, seed=5)
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    assert ns.lookup(toks).num_blocks == 20
    got = ns.load(toks)
    assert same_bits(got, kv)
    windows = -(-20 // load_window(plane.config))  # windows of half the HBM tier
    assert len([e for e in link.events if e.startswith("load")]) == windows > 1
    assert nothing_held(plane)
    check(plane)


def test_the_next_window_is_asked_for_before_this_one_is_released(plane: Plane) -> None:
    """Two windows hold pins at once: the second is asked for before the first is copied
    out, the third once the first's release has run."""
    ns, toks, kv = on_nvme_only(plane, BLOCKS, seed=1)
    got = ns.load(toks)
    assert same_bits(got, kv)
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    agent_events = [e for e in link.events if e.startswith("load") or e == "release"]
    assert agent_events == ["load 0", "load 1", "release", "load 2", "release", "release"]
    assert link._loads == 3  # no window came back short: each release ran before the next
    assert nothing_held(plane)
    check(plane)


def test_a_window_whose_answer_fails_mid_pipeline_gives_back_every_pin(plane: Plane) -> None:
    """The second window's load ran (its blocks pinned for the client) but its answer never
    came, neither when asked beside the first nor alone again (the fourth load asked: the
    third was asked ahead, and given up): the load returns the first window alone, exact,
    and nothing stays pinned."""
    ns, toks, kv = on_nvme_only(plane, BLOCKS, seed=2)
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    for n in (1, 3):
        link.on_load[n] = lambda answer: type(answer)(None, UnavailableError("no answer"))
    got = ns.load(toks)
    assert same_bits(got, kv[:, :, :, : 2 * T])
    assert "load 4" not in link.events  # nothing asked after the window that failed alone
    assert nothing_held(plane)
    check(plane)


def test_a_corrupt_window_gives_back_the_window_asked_ahead(plane: Plane) -> None:
    """A block of the first window goes bad in HBM after the agent verified it: the load
    keeps the block before it, quarantines it, and gives up the window already pinned ahead."""
    ns, toks, kv = on_nvme_only(plane, BLOCKS, seed=3)
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    hbm = plane.tiers[(NODE, Tier.HBM)]

    def corrupt_second(answer: Any) -> Any:
        bad = answer.value.blocks[1]
        hbm.store.arena.slot_view(bad.slot)[5] ^= 0xFF
        return answer

    link.on_load[0] = corrupt_second
    got = ns.load(toks)
    assert same_bits(got, kv[:, :, :, :T])
    assert "load 1" in link.events and "give_up" in link.events
    assert nothing_held(plane)
    assert hbm.stats().store.quarantined == 1
    check(plane)


def test_a_window_that_fails_beside_the_last_is_asked_again_alone(plane: Plane) -> None:
    ns, toks, kv = on_nvme_only(plane, BLOCKS, seed=6)
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    link.on_load[1] = lambda answer: type(answer)(None, UnavailableError("no answer"))
    got = ns.load(toks)
    assert same_bits(got, kv)
    assert nothing_held(plane)
    check(plane)


def test_a_window_short_of_room_beside_the_last_is_asked_again(plane: Plane) -> None:
    """HBM had room for only part of a window asked while the one before it was pinned:
    its rest is asked for again once nothing else is held, and the load is whole."""
    ns, toks, kv = on_nvme_only(plane, BLOCKS, seed=4)
    link: ScriptedLink = plane.link  # type: ignore[assignment]
    agent = plane.agents[NODE]

    def keep_one(answer: Any) -> Any:
        result = answer.value
        agent.release([b.lease for b in result.blocks[1:]])
        return type(answer)(type(result)(result.arena, result.blocks[:1]), None)

    link.on_load[1] = keep_one
    got = ns.load(toks)
    assert same_bits(got, kv)
    assert [e for e in link.events if e.startswith("load")] == [
        "load 0", "load 1", "load 2", "load 3", "load 4"]
    assert nothing_held(plane)
    check(plane)
