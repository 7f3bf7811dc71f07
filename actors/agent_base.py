"""What the offload agent's parts share: its state and the plumbing every part calls.

The agent is split by concern (``agent.py`` loads, ``agent_stores.py`` stores,
``agent_peers.py`` serves other nodes, ``agent_demote.py`` moves evicted blocks down,
``agent_pool.py`` writes to the pool);
each part is a mixin over this base, which holds the state and the calls into the tiers:
the arenas of every tier incarnation still in use (``_arena(epoch)``), and the ways leases end
(``_give_back`` on error paths, waited for; ``_let_go``, one way, off a load's path).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from cmx.actors.arena_tier import ArenaInfo, Pinned
from cmx.actors.links import actor_name
from cmx.actors.scheduler import Scheduler
from cmx.actors.transport import PeerInfo, Region, Transport
from cmx.config import ServiceConfig
from cmx.errors import CmxError, UnavailableError
from cmx.keys import BlockHash
from cmx.metrics import Histogram
from cmx.policies.admission import AdmissionPolicy
from cmx.policies.placement import PlacementPolicy
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.tiers import Tier

__all__ = ["AgentBase", "StaleEpochError", "pin_tag"]

# Batch calls of a tier that do nothing for no keys: those answering a list, and the others.
_EMPTY_LIST_CALLS = frozenset({"pin", "reserve", "acquire", "commit_pinned"})
_EMPTY_NONE_CALLS = frozenset({"unpin", "abort"})
_NO_ANSWER = object()
log = logging.getLogger(__name__)

START_WAIT_S = 180.0  # how long a starting agent waits for its node's tiers to answer
KEEP_EPOCHS = 4  # arenas of earlier incarnations of a tier kept mapped for grants still in use


class StaleEpochError(CmxError):
    """A grant or pin of a tier incarnation whose arena is no longer mapped here."""


class AgentBase:
    node: str
    name: str
    config: ServiceConfig
    link: Any
    scheduler: Scheduler
    transport: Transport
    nvme: ExtentPlane  # the NVMe tier's bytes (agent_nvme.py)
    pool_admission: AdmissionPolicy
    nvme_admission: AdmissionPolicy  # which blocks DRAM may write to NVMe
    placement_policy: PlacementPolicy  # write-through or write-back, over DRAM then NVMe
    moved: Counter[str]  # "src->dst" -> bytes
    moved_via: Counter[str]  # transport, "local" or "nvme" -> bytes
    dropped: Counter[str]  # why evicted blocks were not demoted -> blocks
    corrupt: Counter[str]  # where a copy failed its checksum -> blocks
    latency: dict[str, Histogram]
    _arenas: dict[Tier, tuple[ArenaInfo, SharedArena]]  # the current incarnation's
    _epochs: dict[str, tuple[ArenaInfo, SharedArena]]  # by epoch: current and a few earlier
    owner: str  # whom the tiers' leases of this agent name
    _peers: dict[str, PeerInfo]  # actor name -> what it published

    def _call(self, tier: Tier, method: str, *args: object) -> Any:
        return self._call_many([(tier, method, args)])[0]

    def _call_many(self, calls: Sequence[tuple[Tier, str, tuple[object, ...]]],
                   return_exceptions: bool = False) -> list[Any]:
        """Calls to this node's tiers, all in flight at once; their answers in order (with
        ``return_exceptions``, a failed call's error in its place)."""
        results = [_empty_answer(method, args) for _, method, args in calls]
        todo = [i for i, r in enumerate(results) if r is _NO_ANSWER]
        if todo:
            answers = self.link.call_many(
                [(actor_name(calls[i][0].value, self.node), calls[i][1], calls[i][2])
                 for i in todo], return_exceptions=return_exceptions)
            for i, answer in zip(todo, answers):
                self._check_epoch(calls[i][0], answer)
                results[i] = answer
        return results

    def _commit_tagged(self, tier: Tier, commits: Sequence[tuple[str, tuple[int, int, int]]],
                       wait: bool, owner: str) -> list[Pinned | None]:
        """``commit_pinned`` in ``tier`` of each (namespace id, (lease, size, checksum)): one
        call per namespace, all in flight at once; the pins in the order of ``commits``."""
        groups: dict[str, list[int]] = {}
        for n, (tag, _) in enumerate(commits):
            groups.setdefault(tag, []).append(n)
        answers = self._call_many([
            (tier, "commit_pinned", ([commits[n][1] for n in idx], tag, wait, owner))
            for tag, idx in groups.items()])
        out: list[Pinned | None] = [None] * len(commits)
        for idx, pins in zip(groups.values(), answers):
            for n, pin in zip(idx, pins):
                out[n] = pin
        return out

    def _pin_memory(self, keys: Sequence[BlockHash], owner: str
                    ) -> list[tuple[Tier, list[Pinned | None]]]:
        """Pin ``keys`` in HBM and DRAM at once, for ``owner``. A tier that fails holds
        nothing for this call, and the other's pins are still handed back: raising would
        leave them held (until they expire) and lose the copies that tier has."""
        tiers = (Tier.HBM, Tier.DRAM)
        answers = self._call_many([(t, "pin", (list(keys), owner)) for t in tiers],
                                  return_exceptions=True)
        out = []
        for tier, answer in zip(tiers, answers):
            if isinstance(answer, BaseException):
                log.warning("%s did not pin: %s", tier.value, answer)
                answer = [None] * len(keys)
            out.append((tier, answer))
        return out

    def _give_back(self, tier: Tier, unpin: Sequence[int] = (),
                   abort: Sequence[int] = ()) -> None:
        """End leases on an error path. A tier that does not answer keeps them only until
        they expire (or it restarted, and they went with it)."""
        calls = [(tier, m, (list(ls),)) for m, ls in (("unpin", unpin), ("abort", abort)) if ls]
        try:
            self._call_many(calls)
        except CmxError as exc:
            log.warning("%s did not take back leases: %s", tier.value, exc)

    def _let_go(self, tier: Tier, leases: Sequence[int]) -> None:
        """End pins nobody waits on: one way, off the load's path. Should the message be
        lost, the pins expire."""
        if leases:
            self.link.tell(actor_name(tier.value, self.node), "unpin", list(leases))

    def _check_epoch(self, tier: Tier, result: object) -> None:
        """A tier that restarted has a new arena: map it before its slots are used. Grants
        and pins of the earlier one are still used in *its* arena (``_arena``), never here."""
        if tier not in self._arenas or not isinstance(result, list):
            return
        epochs = {getattr(r, "epoch", None) for r in result} - {None}
        if epochs - self._epochs.keys():
            self._attach(tier)

    def _arena(self, epoch: str) -> SharedArena:
        """The arena of a tier's incarnation: where a grant or pin of that epoch is valid.

        An earlier incarnation's arena stays mapped, so a copy into an old grant lands in
        memory no live tier uses (its commit is then refused) instead of in the slot of
        whatever block the new incarnation put there."""
        mapped = self._epochs.get(epoch)
        if mapped is None:
            raise StaleEpochError(f"no arena of epoch {epoch} is mapped here")
        return mapped[1]

    def _attach_when_up(self, tier: Tier, within_s: float = START_WAIT_S) -> None:
        """``_attach`` at the agent's start, waiting for a tier that is restarting (killed with
        the agent, or its node restarting): Ray never restarts an actor whose start raised, so
        an agent that gave up at once would stay dead for good."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                self._attach(tier)
                return
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _attach(self, tier: Tier) -> None:
        info: ArenaInfo = self.link.call(actor_name(tier.value, self.node), "info")
        if info.epoch in self._epochs:
            return
        arena = SharedArena.attach(info.arena, populate=True)  # every block passes through here
        self._arenas[tier] = (info, arena)
        self._epochs[info.epoch] = (info, arena)
        of_tier = [e for e, (i, _) in self._epochs.items() if i.tier is tier]
        for old in of_tier[:-KEEP_EPOCHS]:
            # Not closed: a copy still running may hold a view; the mapping goes with the last.
            del self._epochs[old]
        self.transport.register(
            Region(info.arena, arena.buffer.ctypes.data, info.slot_bytes, info.num_slots),
            arena.buffer,
        )

    def _peer(self, actor: str, refresh: bool = False) -> PeerInfo:
        info = None if refresh else self._peers.get(actor)
        if info is None:
            info = self._peers[actor] = self.link.call(actor, "peer_info")
        return info


def _empty_answer(method: str, args: tuple[object, ...]) -> Any:
    """What a batch call answers for no keys, without the round trip; _NO_ANSWER otherwise."""
    if args and isinstance(args[0], list) and not args[0]:
        if method in _EMPTY_LIST_CALLS:
            return []
        if method in _EMPTY_NONE_CALLS:
            return None
    return _NO_ANSWER


def pin_tag(pin: Pinned | Extent) -> str:
    """The namespace id of a pinned copy: a memory tier's pin, or an NVMe extent."""
    return pin.namespace if isinstance(pin, Pinned) else pin.tag
