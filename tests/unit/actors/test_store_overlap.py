"""A write-through store copies window k+1 while window k commits and writes through. Each
window's blocks stay pinned (leases of the store's owner) from their commit until their NVMe
copies are made, so the next window's grants never evict a block before it reaches NVMe; and
a write-through that fails gives back every pin and reservation it took."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import BLOCK, LAYOUT, check, held, small_config

from cmx.client import NamespaceClient
from cmx.doors import CommitStore, GrantStore, Pending, Request
from cmx.links import LocalLink
from cmx.tiers import Tier

R = TypeVar("R")
NODE = f"overlap-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens


class Deferred:
    """A commit the client sent, run when the client's next grant arrives (or its answer is
    asked for)."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run = run
        self.answer: Any = None
        self.ran = False

    def run(self) -> Any:
        if not self.ran:
            self.ran = True
            self.answer = self._run()
        return self.answer


class InterleavingLink(LocalLink):
    """Runs a store's calls in the worst order an agent serving calls concurrently allows: a
    ``commit_store`` the client sends runs when its next ``grant_store`` arrives, and that
    grant runs inside it, right after the commit's DRAM commit and before its write-through
    (``after_dram_commit``). ``events`` keeps the order the client sent and waited."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.events: list[str] = []
        self._sent: list[Deferred] = []
        self._inside: Callable[[], None] | None = None

    def submit(self, name: str, request: Request[R]) -> Pending[R]:
        if not isinstance(request, CommitStore):
            return super().submit(name, request)
        self.events.append("commit")
        late = Deferred(lambda: LocalLink.submit(self, name, request))
        self._sent.append(late)
        return Pending(request, late)

    def result(self, pending: Pending[R], timeout_s: float | None = None) -> R:
        if isinstance(pending.ref, Deferred):
            self.events.append("wait")
            pending = pending.ref.run()
        return super().result(pending, timeout_s)

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if not isinstance(request, GrantStore):
            return super().call(name, request)
        self.events.append("grant")
        sent = [d for d in self._sent if not d.ran]
        if not sent:
            return super().call(name, request)
        answer: list[Any] = []
        self._inside = lambda: answer.append(LocalLink.call(self, name, request))
        sent[0].run()
        if self._inside is not None:  # the commit failed before its DRAM commit
            self._inside()
            self._inside = None
        return answer[0]

    def flush(self) -> None:
        """Run every commit sent and not yet run: an agent runs them, waited for or not."""
        for late in self._sent:
            late.run()

    def after_dram_commit(self) -> None:
        inside, self._inside = self._inside, None
        if inside is not None:
            inside()


def plane_of(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, dram_blocks: int) -> Plane:
    p = make_plane(small_config(tmp_path, placement="write_through",
                                dram_bytes=dram_blocks * BLOCK),
                   nodes=(NODE,), link_type=InterleavingLink)
    dram = p.tiers[(NODE, Tier.DRAM)]
    link: InterleavingLink = p.link  # type: ignore[assignment]
    for method in ("commit_each", "commit_pinned"):  # whichever the agent commits with
        monkeypatch.setattr(dram, method, _then(getattr(dram, method), link.after_dram_commit))
    return p


def _then(call: Callable[..., Any], after: Callable[[], None]) -> Callable[..., Any]:
    def both(*args: Any, **kwargs: Any) -> Any:
        answer = call(*args, **kwargs)
        after()
        return answer
    return both


@pytest.fixture
def tiny(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    """DRAM of one block: a window is one block, and window k+1 has room only where
    window k lies."""
    p = plane_of(tmp_path, monkeypatch, dram_blocks=1)
    yield p
    p.close()


@pytest.fixture
def plane(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    """DRAM of eight blocks: windows of four."""
    p = plane_of(tmp_path, monkeypatch, dram_blocks=8)
    yield p
    p.close()


def client(plane: Plane) -> NamespaceClient:
    return namespace_client(plane, NODE, LAYOUT, "overlap")


def kv_of(n: int, seed: int) -> tuple[Any, torch.Tensor]:
    toks = np.random.default_rng(seed).integers(0, 50_000, n * T)
    return toks, LAYOUT.random_kv(len(toks), seed=seed)


def nothing_held(plane: Plane) -> bool:
    return all(held(plane, NODE, t) == (0, 0) for t in (Tier.HBM, Tier.DRAM, Tier.NVME))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_next_window_is_granted_and_copied_before_this_one_is_waited_for(
    plane: Plane,
) -> None:
    ns = client(plane)
    toks, kv = kv_of(12, seed=1)  # three windows of four
    handle = ns.store(toks, kv)
    link: InterleavingLink = plane.link  # type: ignore[assignment]
    # Window k-1's commit is waited for before window k+1's grants, never before k's.
    assert link.events == ["grant", "commit", "grant", "commit", "wait", "grant", "commit",
                           "wait"]
    assert handle.wait() == 12
    assert plane.tiers[(NODE, Tier.NVME)].contains(ns.keys(toks)) == [True] * 12
    assert same_bits(ns.load(toks), kv)
    assert nothing_held(plane)
    check(plane)


def test_a_window_evicted_by_the_next_ones_grants_still_reaches_nvme_exact(tiny: Plane) -> None:
    """Each window's grant runs between the commit of the window before and its
    write-through, in a DRAM with room for one block: only a pin held from the commit on
    keeps that block in DRAM until it is written (unpinned, it was evicted, never admitted
    to NVMe, and lost)."""
    ns = client(tiny)
    toks, kv = kv_of(4, seed=2)
    handle = ns.store(toks, kv)
    assert handle.wait() == 4 and handle.refused == ()
    keys = ns.keys(toks)
    assert tiny.tiers[(NODE, Tier.NVME)].contains(keys) == [True] * 4
    assert tiny.agents[NODE].stats().store_commits == {"committed": 4, "refused": 0}
    tiny.tiers[(NODE, Tier.DRAM)].evict(keys)
    assert all({c.tier for c in b.copies} == {Tier.NVME} for b in ns.lookup(toks).blocks)
    assert same_bits(ns.load(toks), kv)  # every block read back from NVMe, verified
    assert nothing_held(tiny)
    check(tiny)


def test_a_write_through_failing_mid_store_leaves_nothing_pinned_or_reserved(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second window's NVMe writes fail: the store raises, and every DRAM pin its
    commits took and every NVMe reservation is given back; the blocks stay storable."""
    agent = plane.agents[NODE]
    write_many = agent.host.nvme.write_many
    calls: list[int] = []

    def fails_second(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk failed")
        return write_many(*args)

    monkeypatch.setattr(agent.host.nvme, "write_many", fails_second)
    ns = client(plane)
    toks, kv = kv_of(12, seed=3)
    with pytest.raises(OSError, match="disk failed"):
        ns.store(toks, kv).wait()
    link: InterleavingLink = plane.link  # type: ignore[assignment]
    link.flush()  # the window sent after the failed one: committed and written through
    assert len(calls) == 3
    assert nothing_held(plane)
    check(plane)
    monkeypatch.setattr(agent.host.nvme, "write_many", write_many)
    plane.tiers[(NODE, Tier.DRAM)].evict(ns.keys(toks))
    assert ns.store(toks, kv).wait() == 12  # and the window whose writes failed reaches NVMe
    assert plane.tiers[(NODE, Tier.NVME)].contains(ns.keys(toks)) == [True] * 12
    assert same_bits(ns.load(toks), kv)
    assert nothing_held(plane)
    check(plane)
