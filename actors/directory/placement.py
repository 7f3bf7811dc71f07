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

A labelled node can be alive and still not run its shard (out of memory, a worker that fails
at start): Ray keeps the pinned actor pending or restarting there, under its name, so
``start_shards`` finds it running. The controller asks every shard where it runs each round
(``ping_shards``); one silent for ``SHARD_SILENT_S`` is stopped (``ShardWatch``) and started
again on another labelled node, its node avoided for ``SHARD_AVOID_S``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx.actors.directory.shard import DirectoryShard
from cmx.config import ServiceConfig
from cmx.protocol import RAY_NAMESPACE, actor_name

__all__ = ["SHARD_AVOID_S", "SHARD_SILENT_S", "DirectoryShardActor", "ShardWatch", "ping_shards",
           "shard_node", "start_shards", "stop_shard"]

log = logging.getLogger(__name__)

SHARD_SILENT_S = 60.0  # a running shard that answers nobody this long is started elsewhere
SHARD_AVOID_S = 600.0  # and the node it was pinned to takes no shard for this long


def shard_node(shard: int, config: ServiceConfig, alive: Mapping[str, Mapping[str, Any]],
               avoid: Collection[str] = ()) -> str | None:
    """The node ``shard`` should start on: one of the alive nodes labelled
    ``config.directory_label`` (Ray's ``ray.nodes()`` entries by node id) not in ``avoid``,
    or None where none is (Ray places it)."""
    if shard < 0:
        raise ValueError(f"shard {shard} is negative")
    held = sorted(node_id for node_id, node in alive.items()
                  if config.directory_label in (node.get("Labels") or {})
                  and node_id not in avoid)
    return held[shard % len(held)] if held else None


class ShardWatch:
    """Which running shards to start again elsewhere (see the module docstring): given where
    each was started and, each round, where each answers from, those silent ``silent_s``;
    the node each was started on is avoided for ``avoid_s``. Time is injected."""

    def __init__(self, silent_s: float = SHARD_SILENT_S, avoid_s: float = SHARD_AVOID_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.silent_s = silent_s
        self.avoid_s = avoid_s
        self._clock = clock
        self._on: dict[int, str | None] = {}  # shard -> node it was started on (None: unknown)
        self._silent_since: dict[int, float] = {}
        self._avoid: dict[str, float] = {}  # node -> until when it takes no shard

    def started(self, placed: Mapping[int, str | None]) -> None:
        """Shards just started, each on its node (None: where Ray placed it)."""
        for shard, node in placed.items():
            self._on[shard] = node
            self._silent_since.pop(shard, None)

    def heard(self, answers: Mapping[int, str | None]) -> list[int]:
        """A round's answers (shard -> the node it answers from; None: silent); the shards
        to stop, so that the next ``start_shards`` starts them away from ``avoid()``."""
        now = self._clock()
        move = []
        for shard, node in answers.items():
            if node is not None:
                self._on[shard] = node
                self._silent_since.pop(shard, None)
                continue
            if now - self._silent_since.setdefault(shard, now) < self.silent_s:
                continue
            move.append(shard)
            del self._silent_since[shard]
            bad = self._on.pop(shard, None)
            if bad is not None:
                self._avoid[bad] = now + self.avoid_s
        return move

    def avoid(self) -> frozenset[str]:
        """Nodes a shard was silent on lately: none starts there."""
        now = self._clock()
        self._avoid = {node: until for node, until in self._avoid.items() if until > now}
        return frozenset(self._avoid)


class DirectoryShardActor(DirectoryShard):
    """A shard as the service runs it: the plain shard, and where it runs."""

    def placed_on(self) -> str:
        """The Ray node id this shard runs on."""
        return str(ray.get_runtime_context().get_node_id())


def start_shards(config: ServiceConfig, alive: Mapping[str, Mapping[str, Any]],
                 options: Mapping[str, Any], avoid: Collection[str] = ()) -> list[int]:
    """Start every shard that is not running, each on its node where nodes are labelled
    (``shard_node``, away from ``avoid``; ``options``: the service's actor options,
    ``get_if_exists`` among them, so that starters at once start one); returns the shards
    started. Waits for none of them."""
    started = []
    for shard in range(config.directory_shards):
        name = actor_name("dir", shard)
        try:
            ray.get_actor(name, namespace=RAY_NAMESPACE)
            continue
        except ValueError:  # never started, or dead for good (its pinned node died)
            pass
        node = shard_node(shard, config, alive, avoid)
        placed = {} if node is None else \
            {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        ray.remote(DirectoryShardActor).options(
            name=name, max_concurrency=1, **placed, **options).remote(
            shard, config.heartbeat_s, config.resync_s)
        started.append(shard)
    return started


def ping_shards(config: ServiceConfig) -> dict[int, str | None]:
    """Where each running shard answers from, all asked at once (None: no answer within
    ``call_timeout_s``); a shard not running is left out (``start_shards`` starts it)."""
    asked: dict[int, Any] = {}  # shard -> its answer to come (a Ray ObjectRef)
    for shard in range(config.directory_shards):
        try:
            asked[shard] = ray.get_actor(actor_name("dir", shard),
                                         namespace=RAY_NAMESPACE).placed_on.remote()
        except ValueError:
            continue
    done, _ = ray.wait(list(asked.values()), num_returns=len(asked),
                       timeout=config.call_timeout_s) if asked else ([], [])
    answers: dict[int, str | None] = {}
    for shard, ref in asked.items():
        try:
            answers[shard] = str(ray.get(ref, timeout=0)) if ref in done else None
        except Exception:  # noqa: BLE001 - a shard that fails to say is silent
            answers[shard] = None
    return answers


def stop_shard(shard: int) -> None:
    """Kill shard ``shard`` for good (its name freed as it dies): ``start_shards`` starts it
    again, empty, where it belongs now."""
    name = actor_name("dir", shard)
    log.warning("directory shard %s answered nobody for too long where it was placed: "
                "starting it again elsewhere", name)
    try:
        ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
    except ValueError:
        pass
