"""The agent loading from other nodes: a peer agent or a pool node stages blocks in its memory,
this agent pulls them into HBM with the transport, each block checked as its pieces land.

Where the directory shows no copy on this node, the load asks the peer to stage at the same
time as it asks this node's HBM for slots (``acquire``, ``StagedAhead``): one round trip
instead of two before the first byte moves. This node's DRAM and NVMe pin their own copies in
that same round trip.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.scheduler import Priority
from cmx.actors.agent.shared import Counters, NodeTiers
from cmx.actors.directory.shard import Copy
from cmx.actors.tiers.arena import Grant, Pinned
from cmx.config import ServiceConfig
from cmx.doors import Acquire, Pin, PinExtents, QuarantineStaged, Stage, Unstage
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.links import Call, actor_name
from cmx.protocol import Loaded, Staged
from cmx.storage.nvme.dataplane import Extent
from cmx.tiers import Tier, node_tiers, tier_spec

__all__ = ["RemoteFills", "StagedAhead"]

log = logging.getLogger(__name__)


@dataclass
class StagedAhead:
    """What was asked at the same time as this node's HBM was asked for slots: blocks a peer
    agent staged, and blocks pinned in this node's DRAM and NVMe. A fill takes what it uses."""

    actor: str  # the peer agent's actor name ("" if none was asked)
    staged: dict[int, Staged | None]  # key index -> what the peer staged
    local: dict[int, Pinned | None] = field(default_factory=dict)  # key index -> DRAM pin
    nvme: dict[int, Extent | None] = field(default_factory=dict)  # key index -> NVMe pin

    def take(self, actor: str, idx: Sequence[int]) -> dict[int, Staged | None]:
        if actor != self.actor:
            return {}
        return {i: self.staged.pop(i) for i in idx if i in self.staged}

    def take_local(self, idx: Sequence[int]) -> dict[int, Pinned | None]:
        return {i: self.local.pop(i) for i in idx if i in self.local}

    def take_nvme(self, idx: Sequence[int]) -> dict[int, Extent | None]:
        return {i: self.nvme.pop(i) for i in idx if i in self.nvme}

    def nvme_first(self, i: int, options: list[tuple[Tier, str]], node: str
                   ) -> list[tuple[Tier, str]]:
        """Key ``i``'s sources, fastest first, but ``node``'s NVMe first where the key was
        pinned there ahead: the directory knows it there alone, and asking DRAM first for a
        copy the directory has not heard of is a round trip for nothing on every window of a
        load from NVMe. DRAM stays a source after it."""
        if self.nvme.get(i) is None:
            return options
        here = (Tier.NVME, node)
        return [here] + [o for o in options if o != here]

    def leftovers(self) -> list[Staged]:
        """Staged blocks no fill took (their HBM slot was not granted, or a fill failed)."""
        rest = [s for s in self.staged.values() if s is not None]
        self.staged.clear()
        return rest

    def local_leftovers(self) -> list[int]:
        """Leases of DRAM pins no fill took (the block was an HBM hit, or a fill failed)."""
        rest = [p.lease for p in self.local.values() if p is not None]
        self.local.clear()
        return rest

    def nvme_leftovers(self) -> list[int]:
        """Leases of NVMe pins no fill took (the block was found in memory, or a fill
        failed)."""
        rest = [p.lease for p in self.nvme.values() if p is not None]
        self.nvme.clear()
        return rest


class RemoteFills:
    def __init__(self, node: str, config: ServiceConfig, tiers: NodeTiers, host: HostBytes,
                 link: Any, transport: str, counters: Counters) -> None:
        self.node = node
        self.config = config
        self.tiers = tiers
        self.host = host  # where the blocks land
        self.link = link
        self.transport = transport  # the transport's name, for what loads report
        self.counters = counters
        self.owner = tiers.owner

    def sources(self, copies: Sequence[Copy]) -> list[tuple[Tier, str]]:
        """Where to look for a block, fastest first: this node's tiers below HBM (DRAM and
        NVMe, and any registered between or below them), then the other nodes' copies, memory
        before NVMe, and the pool last.

        This node's tiers are asked where the directory knows a copy here, in any tier, and
        then all are asked: the directory may lag a demotion (HBM to DRAM, DRAM to NVMe)
        that just happened. Where it knows none, the load goes to the others at once."""
        here = any(c.node == self.node and tier_spec(c.tier).on_node for c in copies)
        # HBM is where the load lands: a copy there is a hit, not a source.
        local = [(t, self.node) for t in node_tiers() if t is not Tier.HBM] if here else []
        remote = sorted(
            {(c.tier, c.node) for c in copies
             if c.node != self.node or not tier_spec(c.tier).on_node},
            key=lambda s: (s[0].rank, s[1]),
        )
        return local + remote

    def _stage_plan(
        self, sources: Sequence[list[tuple[Tier, str]]]
    ) -> tuple[str, list[int]] | None:
        """The peer agent a load will try first for the most keys, and those keys: the ones
        whose first source (``sources``, per key, from ``sources``) is that peer."""
        first: dict[int, str] = {}
        for i, options in enumerate(sources):
            if options and options[0][1] != self.node and tier_spec(options[0][0]).on_node:
                first[i] = options[0][1]
        if not first:
            return None
        node, _ = Counter(first.values()).most_common(1)[0]
        return actor_name("agent", node), [i for i, n in first.items() if n == node]

    def _pin_plan(self, copies: Sequence[Sequence[Copy]]) -> list[int]:
        """Keys the directory knows in this node's DRAM but not in its HBM: a load will copy
        them from DRAM, so they are pinned there while HBM is asked for slots."""
        here = [{c.tier for c in cs if c.node == self.node} for cs in copies]
        return [i for i, tiers in enumerate(here) if Tier.DRAM in tiers and Tier.HBM not in tiers]

    def _nvme_plan(self, copies: Sequence[Sequence[Copy]]) -> list[int]:
        """Keys the directory knows on this node's NVMe alone: a load will read them from
        there, so they are pinned there while HBM is asked for slots (the pin is otherwise one
        more round trip, after the HBM victims' demotion, before the disk is asked)."""
        here = [{c.tier for c in cs if c.node == self.node} for cs in copies]
        return [i for i, tiers in enumerate(here) if tiers == {Tier.NVME}]

    def acquire(
        self, keys: Sequence[BlockHash], sources: Sequence[list[tuple[Tier, str]]],
        copies: Sequence[Sequence[Copy]], owner: str,
    ) -> tuple[list[Pinned | Grant | None], StagedAhead]:
        """HBM's ``acquire`` of ``keys`` for ``owner``; at the same time, the likely peer
        stages its blocks and this node's DRAM pins its own: one round trip for all."""
        items = [(k, keys[i - 1] if i else None) for i, k in enumerate(keys)]
        plan = self._stage_plan(sources)
        local = self._pin_plan(copies)
        disk = self._nvme_plan(copies)
        calls: list[Call] = [
            (actor_name(Tier.HBM.value, self.node), Acquire(items=items, owner=owner))]
        if plan is not None:
            calls.append((plan[0], Stage(keys=[keys[i] for i in plan[1]], owner=self.owner)))
        if local:
            calls.append((actor_name(Tier.DRAM.value, self.node),
                          Pin(keys=[keys[i] for i in local], owner=self.owner)))
        if disk:
            calls.append((actor_name(Tier.NVME.value, self.node),
                          PinExtents(keys=[keys[i] for i in disk], owner=self.owner)))
        answers = self.link.call_many(
            calls, timeout_s=self.config.load_timeout_s, return_exceptions=True)
        held = answers[0]
        ahead = StagedAhead(plan[0] if plan is not None else "", {})
        if plan is not None:
            if isinstance(answers[1], BaseException):
                log.warning("staging ahead at %s failed: %s", plan[0], answers[1])
            else:
                ahead.staged = dict(zip(plan[1], answers[1]))
        dram_answer = answers[1 + (plan is not None)] if local else []
        if local and not isinstance(dram_answer, BaseException):
            self.tiers.check_epoch(Tier.DRAM, dram_answer)
            ahead.local = dict(zip(local, dram_answer))
        if disk and not isinstance(answers[-1], BaseException):
            ahead.nvme = dict(zip(disk, answers[-1]))
        if isinstance(held, BaseException):
            self.release_ahead(ahead)
            raise held
        self.tiers.check_epoch(Tier.HBM, held)
        return held, ahead

    def release_ahead(self, ahead: StagedAhead) -> None:
        if ahead.actor:
            self._unstage(ahead.actor, ahead.leftovers(), wait=False)
        if rest := ahead.local_leftovers():
            self.tiers.let_go(Tier.DRAM, rest)
        if rest := ahead.nvme_leftovers():
            self.tiers.let_go(Tier.NVME, rest)

    def fill(
        self, peer_agent: str, node: str, keys: Sequence[BlockHash], idx: list[int],
        granted: dict[int, Grant], priority: Priority, ahead: StagedAhead | None = None,
    ) -> dict[int, Loaded]:
        """Pull blocks from a peer (an agent or a pool node), window by window: a peer stages
        what its memory holds at once, the rest goes in later windows. Stops when a window
        stages nothing (the peer has none of the rest). Blocks the peer staged ahead (while
        this node's HBM was asked) make the first window."""
        out: dict[int, Loaded] = {}
        pre = ahead.take(peer_agent, idx) if ahead is not None else {}
        todo = [i for i in idx if pre.get(i) is None]
        if any(s is not None for s in pre.values()):
            first = [i for i in idx if i in pre]
            out.update(self._pull_staged(peer_agent, node, keys, first, [pre[i] for i in first],
                                         granted, priority, more=bool(todo)))
        while todo:
            staged: list[Staged | None] = self.link.call(
                peer_agent, Stage(keys=[keys[i] for i in todo], owner=self.owner),
                timeout_s=self.config.load_timeout_s,
            )
            if all(s is None for s in staged):
                break
            more = any(s is None for s in staged)
            out.update(self._pull_staged(peer_agent, node, keys, todo, staged, granted, priority,
                                         more))
            todo = [i for i, s in zip(todo, staged) if s is None]
        return out

    def _pull_staged(
        self, peer_agent: str, node: str, keys: Sequence[BlockHash], idx: list[int],
        staged: list[Staged | None], granted: dict[int, Grant], priority: Priority,
        more: bool,
    ) -> dict[int, Loaded]:
        """Move the blocks a peer staged into their HBM slots, verified; then unstage them.

        With ``more`` windows to come, the peer has let go of these before this returns: its
        next ``stage`` needs the room (a peer serves calls concurrently, so a call merely sent
        first may still run second). After the last window nobody waits for it."""
        try:
            pairs = [(i, s) for i, s in zip(idx, staged) if s is not None]
            intact = self.host.land_staged(peer_agent, pairs, granted, priority)
            out: dict[int, Loaded] = {}
            corrupt: list[Staged] = []
            for i, s in pairs:
                if i not in intact:
                    log.warning("checksum mismatch for %s from %s", keys[i].hex()[:12], node[:8])
                    corrupt.append(s)
                    continue
                out[i] = Loaded(keys[i], granted[i].slot, s.size, s.source_tier, node,
                                self.transport, s.checksum, namespace=s.namespace)
                self.counters.count_move(f"{s.source_tier.value}@peer->hbm", self.transport,
                                         s.size)
            if corrupt:  # after unstaging: a pinned copy cannot be dropped at once
                self.counters.corrupt["peer"] += len(corrupt)
                self._unstage(peer_agent, [s for s in staged if s is not None], wait=True)
                staged = []
                self.link.tell(peer_agent, QuarantineStaged(staged=corrupt))
            return out
        finally:
            self._unstage(peer_agent, [s for s in staged if s is not None], wait=more)

    def _unstage(self, peer_agent: str, staged: list[Staged], wait: bool) -> None:
        if not staged:
            return
        if not wait:
            self.link.tell(peer_agent, Unstage(staged=staged))
            return
        try:
            self.link.call(peer_agent, Unstage(staged=staged))
        except UnavailableError:
            pass  # the peer restarted: its pins went with it
