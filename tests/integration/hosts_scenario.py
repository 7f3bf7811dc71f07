"""The scenario side of the suites on hosts (test_hosts_*.py): a client on another host, a
prefix stored there and held only there, and a load timed and checked against what was stored.

A scenario runs in a process of its own (``hosts_support.on_hosts``) and imports this module
from the folder it is given on its command line; the client class travels to the other host
by value, so that host needs no copy of this folder.
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx import ContextMemory, KVLayout
from cmx.config import ServiceConfig

__all__ = ["Far", "FarClient", "held_only_on", "timed_load"]

CALL_BOUND_S = 300.0  # a call to the far client, on a busy machine
ATTEMPTS = 3


class FarClient:
    """A client on another host (an actor pinned there), storing into namespace ``name``."""

    def __init__(self, config: ServiceConfig, layout: KVLayout, name: str) -> None:
        # A host that joined after the service started gets its node's actors with the
        # controller's next round: wait for them.
        self.cm = ContextMemory.connect(config=config, start_service="wait")
        self.ns = self.cm.namespace(name, layout)

    def where(self) -> tuple[str, str]:
        return self.cm.node_id, socket.gethostname()

    def store(self, tokens: list[int], kv: Any) -> int:
        return int(self.ns.store(tokens, kv).wait())


class Far:
    """The driver's handle on a ``FarClient`` on node ``node_id``: its node and hostname."""

    def __init__(self, node_id: str, config: ServiceConfig, layout: KVLayout,
                 name: str = "m") -> None:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self.actor = ray.remote(FarClient).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(config, layout, name)
        self.node, self.hostname = self.call("where")

    def call(self, method: str, *args: Any) -> Any:
        # A cable pulled and put back may leave the driver's connection to the far client
        # reset: that call is refused ("temporarily unavailable") and the next one connects.
        for attempt in range(ATTEMPTS):
            try:
                return ray.get(getattr(self.actor, method).remote(*args), timeout=CALL_BOUND_S)
            except ray.exceptions.ActorUnavailableError:
                if attempt == ATTEMPTS - 1:
                    raise
                time.sleep(2)
        raise AssertionError("unreachable")

    def store(self, ns: Any, first: int, blocks: int, seed: int,
              timeout_s: float = 60.0) -> tuple[list[int], torch.Tensor, int, bool]:
        """Store a prefix of ``blocks`` blocks from the far host: (tokens, kv, blocks stored,
        whether ``ns``'s lookups list it held only there within ``timeout_s``)."""
        tokens = list(range(first, first + blocks * ns.layout.block_tokens))
        kv = ns.layout.random_kv(len(tokens), seed=seed)
        stored = self.call("store", tokens, kv)
        return tokens, kv, stored, held_only_on(ns, tokens, self.node, timeout_s)


def held_only_on(ns: Any, tokens: list[int], node: str, timeout_s: float) -> bool:
    """Whether ``ns``'s lookups of ``tokens`` come to list every block, on ``node`` alone."""
    deadline = time.monotonic() + timeout_s
    while True:
        match = ns.lookup(tokens)
        if len(match.blocks) * ns.layout.block_tokens == len(tokens) and \
                {b.node for b in match.blocks} == {node}:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def timed_load(ns: Any, tokens: list[int], kv: torch.Tensor) -> dict[str, Any]:
    """Load ``tokens``: how many came, whether they are exactly the stored prefix (whole
    blocks, each byte as stored), and how long it took."""
    start = time.monotonic()
    got = ns.load(tokens)
    n = int(got.shape[3])
    right = n % ns.layout.block_tokens == 0 and bool(torch.equal(got, kv[:, :, :, :n]))
    return {"tokens": n, "right": right, "s": time.monotonic() - start}
