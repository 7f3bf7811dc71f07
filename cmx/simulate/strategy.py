"""How a caching system moves KV: the part of the simulation that differs between systems.

The hardware and the trace are shared; a ``Strategy`` names the policies (by the registry names
of ``cmx.policies``) and the shape of the data path. Two are built in:

- ``CMX``: the offload agent moves bytes in 2 MiB pieces, 16 in flight, off the serving
  process (its work per I/O on the agent's threads, not the engine's);
  a request's prefix starts moving when it arrives (prefetch); loads come from any node's
  DRAM or NVMe and from the pool; break-even gating. What the service configures, the
  strategy reads from ``ServiceConfig()``'s defaults, never a copy of them: the agent's lanes
  (``agent_workers``) and queue bound (``agent_queue_bound``), the sightings NVMe admission
  asks for (``nvme_admission_min_count``) and the pool's (``pool_admission_min_count``). The
  agent's queues are the service's (``cmx.simulate.agent``).
- ``LMCACHE_LIKE``: the serving process orchestrates every transfer on its own threads
  (``in_process``: one interpreter, beside its engine's host work), one file per
  256-token chunk read by 4 I/O threads, each chunk paying its CPU cost on that one thread; the
  load starts when the request is scheduled (no prefetch); only this node's DRAM and disk;
  every stored chunk written to disk (write-through, no admission); every hit loaded. It keeps
  8 lanes of its own: it is not the service's agent.

A third, ``LMCACHE_GDS_LIKE``, is the LMCache-like strategy with the I/O of the seed's measured
system: GPUDirect Storage reads of one page of one layer each, each initiated by the CPU.

Every strategy's CPU work (its orchestrator's per I/O, copies and checksums where it makes
them) runs on its node's cores, beside the engines' host work (``cores.Cores``): an in-process
orchestrator's on its serving process's threads, the agent's on threads of its own. A copy
already in this node's HBM (vLLM's own prefix cache) is read where it is: no I/O, no CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from cmx.config import ServiceConfig

__all__ = ["CMX", "LMCACHE_GDS_ASYNC_LIKE", "LMCACHE_GDS_LIKE", "LMCACHE_LIKE", "STRATEGIES",
           "Strategy"]

MiB = 1 << 20
_SERVICE = ServiceConfig()  # the service's defaults


@dataclass(frozen=True)
class Strategy:
    name: str
    prefetch: bool  # a request's prefix starts moving on arrival, not when it is scheduled
    peers: bool  # copies on other nodes and in the pool are loadable
    io_bytes: int  # bytes per I/O when io_tokens is None
    io_tokens: int | None  # one I/O per this many tokens (a file per chunk), overrides io_bytes
    io_depth: int  # I/Os in flight per transfer
    per_io_cpu_s: float  # orchestrator time to issue and complete one I/O, serialized
    # a wait per I/O that takes no CPU on the node (a round trip to another process)
    per_io_wait_s: float = 0.0
    lanes: int = _SERVICE.agent_workers  # transfers one node's mover runs at once
    # queued jobs per priority class; a job finding its class full waits for a place
    queue_bound: int = _SERVICE.agent_queue_bound
    control_s: float = 200e-6  # fixed control cost per load: lookup, pins, slot grants
    eviction: str = "lru"  # cmx.policies.eviction registry name
    admission: str = "frequency"  # cmx.policies.admission registry name
    admission_min_count: int = _SERVICE.nvme_admission_min_count  # sightings before NVMe
    pool_admission_min_count: int = _SERVICE.pool_admission_min_count  # before the pool
    placement: str = "write_back"  # cmx.policies.placement: write_back or write_through
    prefetch_policy: str = "wait_complete"  # cmx.policies.prefetch registry name
    gating: bool = True  # break-even: recompute where a load would be slower
    pool: bool = True  # admitted blocks are copied to the pool (rendezvous owners)
    verify_bandwidth: float | None = None  # checksum bytes/s on disk and network reads
    # The consumer checks each block where it uses it (the client, on a host without a GPU):
    # one more checksum pass on every load, from any tier, at ``verify_bandwidth``
    consumer_verifies: bool = False
    copy_out_bandwidth: float | None = None  # a host copy of each loaded byte; None on a GPU
    # The orchestrator is a library in the serving process: its work per I/O (loads and
    # stores) runs on that process's threads, beside the engine's own host work. Otherwise it
    # runs on the offload agent's threads, on the node's other cores (or a DPU's).
    in_process: bool = False

    def __post_init__(self) -> None:
        if self.io_bytes <= 0 or self.io_depth < 1 or self.lanes < 1 or self.queue_bound < 1:
            raise ValueError(f"{self.name}: io_bytes, io_depth, lanes, queue_bound must be >= 1")
        if self.io_tokens is not None and self.io_tokens < 1:
            raise ValueError(f"{self.name}: io_tokens must be >= 1, got {self.io_tokens}")
        if self.per_io_cpu_s < 0 or self.per_io_wait_s < 0 or self.control_s < 0:
            raise ValueError(f"{self.name}: per_io_cpu_s, per_io_wait_s and control_s must be "
                             f">= 0")

    def io_size(self, token_bytes: int) -> int:
        return self.io_tokens * token_bytes if self.io_tokens else self.io_bytes

    def with_(self, **changes: Any) -> Strategy:
        return replace(self, **changes)


CMX = Strategy("cmx", prefetch=True, peers=True, io_bytes=2 * MiB, io_tokens=None,
               io_depth=16, per_io_cpu_s=5e-6)

LMCACHE_LIKE = Strategy(
    "lmcache-like", prefetch=False, peers=False, io_bytes=32 * MiB, io_tokens=256, io_depth=4,
    per_io_cpu_s=500e-6, lanes=8, control_s=1e-3, admission="always", placement="write_through",
    gating=False, pool=False, in_process=True)

# The seed's measured system: GDS reads, each of one 16-token page of one layer (64 KiB of
# Llama-3-8B's KV), each initiated by the serving process's CPU (20 us an I/O: assumed).
LMCACHE_GDS_LIKE = LMCACHE_LIKE.with_(name="lmcache-gds-like", io_bytes=64 << 10,
                                      io_tokens=None, per_io_cpu_s=20e-6)

# The same reads kept 64 in flight (cuFile's batch API): the drive's latency no longer sets
# the pace, the serving process's thread initiating each read does (assumed depth).
LMCACHE_GDS_ASYNC_LIKE = LMCACHE_GDS_LIKE.with_(name="lmcache-gds-async-like", io_depth=64)

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (CMX, LMCACHE_LIKE, LMCACHE_GDS_LIKE,
                                                       LMCACHE_GDS_ASYNC_LIKE)}

# What ``cmx simulate --without`` turns off, each one part of a strategy.
ABLATIONS: dict[str, dict[str, Any]] = {
    "peers": {"peers": False},  # only this node's copies load; other nodes' and the pool's don't
    "pool": {"pool": False},  # admitted blocks are not copied to the pool
    "prefetch": {"prefetch": False},  # a prefix moves when its request is scheduled
    "admission": {"admission": "always"},  # every block is admitted to NVMe at once
    "gating": {"gating": False},  # every hit loads, even where recompute would be faster
}


def without(strategy: Strategy, parts: Sequence[str]) -> Strategy:
    """``strategy`` with each of ``parts`` (names in ``ABLATIONS``) turned off, and named so;
    unchanged for no parts. ValueError for a part not known."""
    unknown = sorted(set(parts) - set(ABLATIONS))
    if unknown:
        raise ValueError(f"unknown parts {unknown}; known: {sorted(ABLATIONS)}")
    if not parts:
        return strategy
    changes = {k: v for part in parts for k, v in ABLATIONS[part].items()}
    return strategy.with_(name=f"{strategy.name} without {','.join(parts)}", **changes)
