"""The directory's answer to a request: each block's best copy, seen from the node asking.

The one rule: the kind of copy the break-even policy says is cheapest to load (by its link
costs: a tier, here or on a peer); among the nodes holding the cheapest kind, one drawn at
random, so readers of a hot prefix spread over its holders. Every copy chosen counts as a
sighting of it on its holder (``Mover.sighted``: admission counts them).
"""

from __future__ import annotations

from collections.abc import Callable

from cmx.policies.breakeven import BreakEven
from cmx.simulate.cluster import DRAM, HBM, NVME, POOL, Cluster, Node
from cmx.simulate.movement import Mover

__all__ = ["Lookup"]

_NAMES = {HBM: "hbm", DRAM: "dram", NVME: "nvme", POOL: "pool"}


class Lookup:
    def __init__(self, cluster: Cluster, mover: Mover, breakeven: BreakEven,
                 draw: Callable[[], float]) -> None:
        self.cluster = cluster
        self.mover = mover
        self.draw = draw
        # (tier, local) kinds of copy, cheapest first; peers' only where the strategy reads
        # from peers.
        kinds = [(t, True) for t in (HBM, DRAM, NVME)]
        if cluster.strategy.peers:
            kinds += [(t, False) for t in (HBM, DRAM, NVME, POOL)]

        def cost(kind: tuple[int, bool]) -> float:
            cls = _NAMES[kind[0]] if kind[1] else f"{_NAMES[kind[0]]}@peer"
            return breakeven.link(cls).seconds(mover.unit_bytes)

        self.order = sorted(kinds, key=cost)

    def find(self, keys: list[bytes], here: Node) -> list[int]:
        """Each key's best copy (a location code), for the longest prefix that has one."""
        out: list[int] = []
        directory = self.cluster.directory
        nodes, sighted, draw = self.cluster.all_nodes, self.mover.sighted, self.draw
        index = here.index
        for key in keys:
            tiers = directory.get(key)
            if tiers is None:
                break
            best = -1
            for tier, local in self.order:
                holders = tiers[tier]
                if holders is None:
                    continue
                if local:
                    if index in holders:
                        best = index * 4 + tier
                        break
                else:
                    best = holders.pick(draw()) * 4 + tier
                    break
            if best < 0:
                break
            sighted(nodes[best >> 2], key)
            out.append(best)
        return out
