"""What the namespace-tag scenarios share: a namespace id, restarts of the directory and of a
pool node, the drop a client makes, and where the directory sees a block's copies."""

from __future__ import annotations

from plane import NODE_A, Plane
from scenarios import BLOCK

from cmx.actors.directory.shard import DirectoryShard
from cmx.actors.pool.node import PoolNodeService
from cmx.actors.service import Controller
from cmx.client import ContextMemory
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.tiers import Tier

NS = "0123456789abcdef"  # a namespace id, as blocks are tagged with


def restart_directory(plane: Plane) -> None:
    """Every directory shard anew, empty: what it knows comes back from the tiers."""
    for i in range(len(plane.shards)):
        plane.shards[i] = plane.link._targets[actor_name("dir", i)] = DirectoryShard(i)  # type: ignore[attr-defined]


class PoolMembers(Controller):
    """The controller's answer to who is in the pool, without the cluster it watches."""

    def __init__(self, members: list[str]) -> None:
        self.pool = set(members)


def start_pool(plane: Plane, node: str, root: str = "") -> PoolNodeService:
    """The pool node ``node`` on its store directory (what its disk holds comes back)."""
    cfg = plane.config
    root = root or f"{cfg.nvme_dir}/pool-{node}"
    pool = PoolNodeService(node, node, root, 64 * BLOCK, BLOCK,
                           8 * BLOCK, plane.link, cfg.directory_shards, cfg.transport,
                           segment_bytes=cfg.nvme_segment_bytes, lease_s=cfg.lease_s,
                           clock=plane.clock)
    plane.link._targets[actor_name("pool", node)] = pool  # type: ignore[attr-defined]
    return pool


def drop(plane: Plane) -> int:
    """``ContextMemory.drop_namespace`` of NS, over the plane's link."""
    cm = ContextMemory(plane.config, NODE_A, owns_ray=False)
    cm.link = plane.link  # type: ignore[assignment]
    return cm.drop_namespace(NS)


def reannounce(plane: Plane, *more: object) -> None:
    """Every tier's (and pool node's) next heartbeat: the restarted shards learn it all again."""
    for tier in [*plane.tiers.values(), *more]:
        assert tier.heartbeat()  # type: ignore[attr-defined]


def held_in(plane: Plane, keys: list[BlockHash]) -> set[Tier]:
    """The tiers the directory lists copies of ``keys`` in, once every tier's events are in
    (a load tells the directory of its copies behind its answer)."""
    for tier in plane.tiers.values():
        tier.publisher.flush()
    return {c.tier for copies in plane.lookup(list(keys)) for c in copies}
