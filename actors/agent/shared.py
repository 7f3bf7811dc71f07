"""What the offload agent's parts share: this node's tiers, the peers, the counters.

The agent (``core.py``) is built from parts with explicit dependencies, each a module of this
package: loads (``loads``), fills from other nodes (``fetch``), stores (``stores``), demotion
(``demote``), NVMe writes (``nvme``), pool writes (``pool``), serving peers (``peers``),
partial loads (``slices``), and the host's bytes (``host``: memory mapped here, or over NIXL
from a DPU). Each is given what it uses from here:

- ``NodeTiers``: the node's tier actors: their calls, the arenas of every incarnation still
  in use (``arena(epoch)``), and the ways leases end (``give_back`` on error paths, waited
  for; ``let_go``, one way, off a load's path);
- ``Peers``: what other agents publish for transfers;
- ``Counters``: what the parts count, for the agent's stats.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cmx.actors.tiers.arena import ArenaInfo, Pinned
from cmx.actors.transport.base import PeerInfo, Region, Transport
from cmx.doors import (
    Abort,
    ArenaInfoOf,
    CommitPinned,
    PeerInfoOf,
    Pin,
    Request,
    Unpin,
)
from cmx.errors import CmxError, UnavailableError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.metrics import Histogram
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Holds, Tier, node_tiers

__all__ = ["Counters", "NodeTiers", "Peers", "StaleEpochError", "pin_tag"]

# Batch calls of a tier that do nothing for no keys: those answering a list, and the others.
_EMPTY_LIST_CALLS = frozenset({"pin", "reserve", "acquire", "commit_pinned"})
_EMPTY_NONE_CALLS = frozenset({"unpin", "abort"})
R = TypeVar("R")
_NO_ANSWER = object()
log = logging.getLogger(__name__)

START_WAIT_S = 180.0  # how long a starting agent waits for its node's tiers to answer
KEEP_EPOCHS = 4  # arenas of earlier incarnations of a tier kept mapped for grants still in use


class StaleEpochError(CmxError):
    """A grant or pin of a tier incarnation whose arena is no longer mapped here."""


class NodeTiers:
    """This node's HBM, DRAM and NVMe tier actors as the agent's parts reach them: their
    books (calls, batched and in flight at once; the ways leases end) and the arenas of every
    incarnation still in use. A DPU agent's variant reaches the arenas through its host
    (``dpu.agent.HostTiers``)."""

    keep_epochs = KEEP_EPOCHS

    def __init__(self, node: str, link: Any, owner: str, transport: Transport) -> None:
        self.node = node
        self.link = link
        self.owner = owner  # whom the tiers' leases of this agent name
        self.transport = transport  # every arena mapped here is registered with it
        self._arenas: dict[Tier, tuple[ArenaInfo, Any]] = {}  # the current incarnation's
        self._epochs: dict[str, tuple[ArenaInfo, Any]] = {}  # by epoch: current and earlier

    def call(self, tier: Tier, request: Request[R]) -> R:
        answer: R = self.call_many([(tier, request)])[0]
        return answer

    def call_many(self, calls: Sequence[tuple[Tier, Request[Any]]],
                  return_exceptions: bool = False) -> list[Any]:
        """Calls to this node's tiers, all in flight at once; their answers in order (with
        ``return_exceptions``, a failed call's error in its place)."""
        results = [_empty_answer(request) for _, request in calls]
        todo = [i for i, r in enumerate(results) if r is _NO_ANSWER]
        if todo:
            answers = self.link.call_many(
                [(actor_name(calls[i][0].value, self.node), calls[i][1]) for i in todo],
                return_exceptions=return_exceptions)
            for i, answer in zip(todo, answers):
                self.check_epoch(calls[i][0], answer)
                results[i] = answer
        return results

    def commit_tagged(self, tier: Tier, commits: Sequence[tuple[str, tuple[int, int, int]]],
                      wait: bool, owner: str, listed: bool = True) -> list[Pinned | None]:
        """``commit_pinned`` in ``tier`` of each (namespace id, (lease, size, checksum)): one
        call per namespace, all in flight at once; the pins in the order of ``commits``."""
        groups: dict[str, list[int]] = {}
        for n, (tag, _) in enumerate(commits):
            groups.setdefault(tag, []).append(n)
        answers = self.call_many([
            (tier, CommitPinned(items=[commits[n][1] for n in idx], namespace=tag, wait=wait,
                                owner=owner, listed=listed))
            for tag, idx in groups.items()])
        out: list[Pinned | None] = [None] * len(commits)
        for idx, pins in zip(groups.values(), answers):
            for n, pin in zip(idx, pins):
                out[n] = pin
        return out

    def pin_memory(self, keys: Sequence[BlockHash], owner: str
                   ) -> list[tuple[Tier, list[Pinned | None]]]:
        """Pin ``keys`` in every memory tier here (HBM, DRAM, ...) at once, for ``owner``,
        fastest first. A tier that fails holds nothing for this call, and the others' pins are
        still handed back: raising would leave them held (until they expire) and lose the
        copies that tier has."""
        tiers = node_tiers(Holds.MEMORY)
        answers = self.call_many([(t, Pin(keys=list(keys), owner=owner)) for t in tiers],
                                 return_exceptions=True)
        out = []
        for tier, answer in zip(tiers, answers):
            if isinstance(answer, BaseException):
                log.warning("%s did not pin: %s", tier.value, answer)
                answer = [None] * len(keys)
            out.append((tier, answer))
        return out

    def give_back(self, tier: Tier, unpin: Sequence[int] = (),
                  abort: Sequence[int] = ()) -> None:
        """End leases on an error path. A tier that does not answer keeps them only until
        they expire (or it restarted, and they went with it)."""
        calls: list[tuple[Tier, Request[Any]]] = []
        if unpin:
            calls.append((tier, Unpin(leases=list(unpin))))
        if abort:
            calls.append((tier, Abort(leases=list(abort))))
        try:
            self.call_many(calls)
        except CmxError as exc:
            log.warning("%s did not take back leases: %s", tier.value, exc)

    def let_go(self, tier: Tier, leases: Sequence[int]) -> None:
        """End pins nobody waits on: one way, off the load's path. Should the message be
        lost, the pins expire."""
        if leases:
            self.link.tell(actor_name(tier.value, self.node), Unpin(leases=list(leases)))

    def check_epoch(self, tier: Tier, result: object) -> None:
        """A tier that restarted has a new arena: map it before its slots are used. Grants
        and pins of the earlier one are still used in *its* arena (``arena``), never here."""
        if tier not in self._arenas or not isinstance(result, list):
            return
        epochs = {getattr(r, "epoch", None) for r in result} - {None}
        if epochs - self._epochs.keys():
            self.attach(tier)

    def arena(self, epoch: str) -> Any:
        """The arena of a tier's incarnation: where a grant or pin of that epoch is valid.

        An earlier incarnation's arena stays mapped, so a copy into an old grant lands in
        memory no live tier uses (its commit is then refused) instead of in the slot of
        whatever block the new incarnation put there."""
        mapped = self._epochs.get(epoch)
        if mapped is None:
            raise StaleEpochError(f"no arena of epoch {epoch} is mapped here")
        return mapped[1]

    def info(self, epoch: str) -> ArenaInfo | None:
        """What the tier incarnation of ``epoch`` published, if its arena is still in use."""
        mapped = self._epochs.get(epoch)
        return None if mapped is None else mapped[0]

    def current(self, tier: Tier) -> tuple[ArenaInfo, Any]:
        """The info and arena of ``tier``'s current incarnation."""
        return self._arenas[tier]

    def currents(self) -> list[tuple[ArenaInfo, Any]]:
        """The info and arena of each tier's current incarnation."""
        return list(self._arenas.values())

    def in_use(self) -> list[tuple[ArenaInfo, Any]]:
        """Every incarnation's arena still in use, current and earlier."""
        return list(self._epochs.values())

    def attach_when_up(self, tier: Tier, within_s: float = START_WAIT_S) -> None:
        """``attach`` at the agent's start, waiting for a tier that is restarting (killed with
        the agent, or its node restarting): Ray never restarts an actor whose start raised, so
        an agent that gave up at once would stay dead for good."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                self.attach(tier)
                return
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def attach(self, tier: Tier) -> None:
        """The tier's current arena, mapped here (``_map``), beside the ``keep_epochs`` last
        incarnations of it."""
        info = self.link.call(actor_name(tier.value, self.node), ArenaInfoOf())
        if info.epoch in self._epochs:
            return
        arena = self._map(info)
        self._arenas[tier] = (info, arena)
        self._epochs[info.epoch] = (info, arena)
        of_tier = [e for e, (i, _) in self._epochs.items() if i.tier is tier]
        for old in of_tier[:-self.keep_epochs]:
            # Not closed: a copy still running may hold a view; the mapping goes with the last.
            del self._epochs[old]

    def _map(self, info: ArenaInfo) -> Any:
        arena = SharedArena.attach(info.arena, populate=True)  # every block passes through here
        self.transport.register(
            Region(info.arena, arena.buffer.ctypes.data, info.slot_bytes, info.num_slots),
            arena.buffer,
        )
        return arena


class Peers:
    """What other agents and pool nodes publish for transfers (``peer_info``), asked once and
    asked again where it may have changed."""

    def __init__(self, link: Any) -> None:
        self.link = link
        self._known: dict[str, PeerInfo] = {}  # actor name -> what it published

    def get(self, actor: str, refresh: bool = False) -> PeerInfo:
        info = None if refresh else self._known.get(actor)
        if info is None:
            info = self._known[actor] = self.link.call(actor, PeerInfoOf())
        return info

    def holding(self, actor: str, regions: Sequence[str]) -> PeerInfo:
        """What ``actor`` publishes, asked again if it lacks one of ``regions``."""
        peer = self.get(actor)
        if set(regions) - {r.name for r in peer.regions}:
            peer = self.get(actor, refresh=True)  # the peer re-registered its arenas
        return peer

    def forget(self, actor: str) -> None:
        """``actor`` may have restarted: ask it again next time."""
        self._known.pop(actor, None)

    def actor_of(self, agent: str) -> str:
        """The actor name of the peer whose transport agent is ``agent``."""
        return next(a for a, p in self._known.items() if p.agent == agent)


@dataclass
class Counters:
    """What an agent's parts count, for ``AgentStats``."""

    moved: Counter[str] = field(default_factory=Counter)  # "src->dst" -> bytes
    moved_via: Counter[str] = field(default_factory=Counter)  # transport, "local", "nvme"
    dropped: Counter[str] = field(default_factory=Counter)  # why not demoted -> blocks
    corrupt: Counter[str] = field(default_factory=Counter)  # where a checksum failed -> blocks
    commits: Counter[str] = field(default_factory=Counter)  # "committed" or "refused" blocks
    # "nvme_write": the bytes of a batch of NVMe writes; "nvme_books": the tier's reserve
    # and commit around them (the commit flushes: durable before announced).
    latency: dict[str, Histogram] = field(default_factory=lambda: {
        op: Histogram() for op in ("store", "load", "stage", "prefetch", "grant_store",
                                   "nvme_write", "nvme_books")})

    def count_move(self, route: str, via: str, nbytes: int) -> None:
        self.moved[route] += nbytes
        self.moved_via[via] += nbytes


def _empty_answer(request: Request[Any]) -> Any:
    """What a batch call answers for no keys, without the round trip; _NO_ANSWER otherwise."""
    first = next(iter(request.kwargs().values()), None)
    if isinstance(first, list) and not first:
        if request.method in _EMPTY_LIST_CALLS:
            return []
        if request.method in _EMPTY_NONE_CALLS:
            return None
    return _NO_ANSWER


def pin_tag(pin: Pinned | Extent) -> str:
    """The namespace id of a pinned copy: a memory tier's pin, or an NVMe extent."""
    return pin.namespace if isinstance(pin, Pinned) else pin.tag
