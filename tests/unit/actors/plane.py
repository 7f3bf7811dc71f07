"""Two nodes' tiers, agents and a directory in one process, wired by LocalLink (no Ray)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cmx.actors.agent.core import OffloadAgent
from cmx.actors.directory.shard import Copy, DirectoryShard, shard_of
from cmx.actors.tiers.books import make_books
from cmx.client import ContextMemory, NamespaceClient
from cmx.client.node_plane import NodePlane
from cmx.config import ServiceConfig
from cmx.doors import Request
from cmx.keys import Namespace
from cmx.layout import KVLayout
from cmx.links import LocalLink, actor_name
from cmx.tiers import Tier, TierSpec, node_tiers, tier_spec

# Node names of this run: a tier unlinks every arena its node's name left in /dev/shm, so two
# runs on one machine must not share names (arena names keep a node's first 12 characters).
RUN = uuid.uuid4().hex[:5]
NODE_A, NODE_B, NODE_C = f"node-a-{RUN}", f"node-b-{RUN}", f"node-c-{RUN}"
R = TypeVar("R")


class FakeClock:
    """Time that moves only when a test says so: leases expire on cue."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Plane:
    config: ServiceConfig
    link: LocalLink
    shards: list[DirectoryShard]
    agents: dict[str, OffloadAgent]
    tiers: dict[tuple[str, Tier], Any]
    clock: FakeClock

    def lookup(self, keys: Sequence[bytes]) -> list[list[Copy]]:
        n = len(self.shards)
        return [self.shards[shard_of(k, n)].lookup([k])[0] for k in keys]

    def close(self) -> None:
        for agent in self.agents.values():
            agent.close()
        for tier in self.tiers.values():
            tier.close()


class LaggingLink(LocalLink):
    """A LocalLink whose tells run only after the next call: as with Ray actors that serve
    calls concurrently, a call sent after a tell may run before it."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self._told: list[tuple[str, Request[Any]]] = []

    def tell(self, name: str, request: Request[Any]) -> None:
        self._told.append((name, request))

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        told, self._told = self._told, []
        try:
            return super().call(name, request)
        finally:
            for told_name, told_request in told:
                super().tell(told_name, told_request)


def make_plane(config: ServiceConfig, nodes: tuple[str, ...] = (NODE_A, NODE_B),
               link_type: type[LocalLink] = LocalLink,
               specs: Sequence[TierSpec] | None = None) -> Plane:
    """Each node's tiers (``specs``, default every registered node tier: ``cmx.tiers``), its
    agent, and the directory, wired as the service wires them."""
    clock = FakeClock()
    targets: dict[str, Any] = {}
    link = link_type(targets)
    shards = [DirectoryShard(i) for i in range(config.directory_shards)]
    for i, shard in enumerate(shards):
        targets[actor_name("dir", i)] = shard
    specs = [tier_spec(t) for t in node_tiers()] if specs is None else specs
    tiers: dict[tuple[str, Tier], Any] = {}
    for node in nodes:
        for spec in specs:
            books = make_books(spec, node, config, link, clock=clock)
            tiers[(node, spec.tier)] = targets[actor_name(spec.name, node)] = books
    agents = {}
    for node in nodes:
        agents[node] = targets[actor_name("agent", node)] = OffloadAgent(node, config, link)
    return Plane(config, link, shards, agents, tiers, clock)


def namespace_client(plane: Plane, node: str, layout: KVLayout, tenant: str) -> NamespaceClient:
    """A client of ``node`` as an engine holds one, its calls made over the plane's link."""
    cm = ContextMemory(plane.config, node, owns_ray=False)
    cm.link = plane.link  # type: ignore[assignment]
    cm.plane = NodePlane(plane.link, node, 5.0)
    return NamespaceClient(cm, Namespace("m", layout, tenant))
