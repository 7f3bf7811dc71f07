"""Where the directory's shards run, and who starts one again when it is lost.

By default Ray places them (on the head, where the service starts) and restarts one that dies
wherever it can. An operator who wants the directory apart from the serving hosts labels the
nodes that should hold it with ``ServiceConfig.directory_label``: shard ``i`` then starts on
the ``i``-th of those alive (node-id order, round robin), pinned there. Ray's soft node
preference is no use here (it places a zero-CPU actor where it likes), and a pinned actor
whose node died cannot be restarted by Ray: it is dead, and its name free. So the service's
controller calls ``start_shards`` every round, and a shard that is not running starts again,
empty, on a labelled node alive then (or where Ray places it, when none is); the tiers fill
it by resyncing (``shard``'s NEED_RESYNC). Until then its keys are misses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx.actors.directory.shard import DirectoryShard
from cmx.config import ServiceConfig
from cmx.protocol import RAY_NAMESPACE, actor_name

__all__ = ["DirectoryShardActor", "shard_node", "start_shards"]


def shard_node(shard: int, config: ServiceConfig,
               alive: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The node ``shard`` should start on: one of the alive nodes labelled
    ``config.directory_label`` (Ray's ``ray.nodes()`` entries by node id), or None where none
    is (Ray places it)."""
    if shard < 0:
        raise ValueError(f"shard {shard} is negative")
    held = sorted(node_id for node_id, node in alive.items()
                  if config.directory_label in (node.get("Labels") or {}))
    return held[shard % len(held)] if held else None


class DirectoryShardActor(DirectoryShard):
    """A shard as the service runs it: the plain shard, and where it runs."""

    def placed_on(self) -> str:
        """The Ray node id this shard runs on."""
        return str(ray.get_runtime_context().get_node_id())


def start_shards(config: ServiceConfig, alive: Mapping[str, Mapping[str, Any]],
                 options: Mapping[str, Any]) -> list[int]:
    """Start every shard that is not running, each on its node where nodes are labelled
    (``options``: the service's actor options, ``get_if_exists`` among them, so that
    starters at once start one); returns the shards started. Waits for none of them."""
    started = []
    for shard in range(config.directory_shards):
        name = actor_name("dir", shard)
        try:
            ray.get_actor(name, namespace=RAY_NAMESPACE)
            continue
        except ValueError:  # never started, or dead for good (its pinned node died)
            pass
        node = shard_node(shard, config, alive)
        placed = {} if node is None else \
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        ray.remote(DirectoryShardActor).options(
            name=name, max_concurrency=1, **placed, **options).remote(shard)
        started.append(shard)
    return started
