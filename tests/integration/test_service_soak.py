"""A bounded soak: many threads store and load overlapping prefixes through ``ContextMemory`` on
the real cluster while each kind of actor is killed in turn (the HBM, DRAM and NVMe tiers, the
agent, each directory shard, and the pool nodes where a pool runs).

It holds the service to four promises: every load returns the stored bytes or a miss; every
call returns within its bound; once the traffic stops, nothing stays pinned or reserved past the
lease time; and every actor's resident memory stays within what its configuration gives it plus
``OVERHEAD`` (a Ray worker with numpy and torch loaded).

``CMX_SOAK_S`` sets the traffic's length in seconds (default 60, as CI runs it).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import ray
import torch
from traffic import Shape, Traffic, held, kill, nothing_held, until

from cmx.config import ServiceConfig
from cmx.links import RAY_NAMESPACE, actor_name

SOAK_S = float(os.environ.get("CMX_SOAK_S", "60"))
SHAPE = Shape(prefixes=6, shared=2, own=3, loaders=6, storers=2, seed=31)
# A Ray worker's own memory (interpreter, Ray, numpy, torch): 130-140 MiB measured here, and the
# agent 110 MiB above its arenas and staging budget; allowed twice that.
OVERHEAD = 256 << 20
MIN_KILL_GAP_S = 5.0  # kills spread over the soak, at most one per this many seconds


def victims(cm: Any, config: ServiceConfig) -> list[str]:
    """One actor of each kind the service runs, by name."""
    node = cm.node_id
    names = [actor_name(kind, node) for kind in ("hbm", "dram", "nvme", "agent")]
    names += [actor_name("dir", shard) for shard in range(config.directory_shards)]
    controller = ray.get_actor("cmx:controller", namespace=RAY_NAMESPACE)
    pool: list[str] = ray.get(controller.pool_members.remote(), timeout=60)
    names += [actor_name("pool", p) for p in pool]
    return names


def allowance(name: str, config: ServiceConfig) -> int:
    """The memory an actor's configuration gives it, before ``OVERHEAD``."""
    kind = name.split(":")[1]
    return {
        "hbm": config.hbm_bytes,  # emulated HBM: a host arena
        "dram": config.dram_bytes,
        "agent": config.hbm_bytes + config.dram_bytes + config.staging_bytes,  # maps both arenas
        "pool": config.pool_staging_bytes,
    }.get(kind, 0)  # NVMe keeps its blocks on disk; directory, controller: an index


def resident(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


def memory_of_service_actors() -> dict[str, int]:
    """Resident bytes of each alive service actor (this machine runs every node)."""
    from ray._private.state import actors

    out = {}
    for info in actors().values():
        name = info.get("Name") or ""
        if name.startswith("cmx:") and info.get("State") == "ALIVE" and info.get("Pid"):
            try:
                out[name] = resident(int(info["Pid"]))
            except OSError:
                pass  # died since it was listed
    return out


@pytest.mark.timeout(int(SOAK_S) + 600)
def test_soak_with_every_actor_kind_killed_keeps_bytes_right_bounded_and_released(
    cm: Any, config: ServiceConfig
) -> None:
    bound_s = config.load_timeout_s + 2 * config.call_timeout_s
    node = cm.node_id
    names = victims(cm, config)
    killed: list[str] = []
    peak: dict[str, int] = {}
    with Traffic(cm, bound_s, SHAPE) as traffic:
        assert until(lambda: traffic.hits > 0, bound_s), "no load hit before the soak"
        # Each kind is killed once per round, and the service has time to serve between kills.
        gap = max(MIN_KILL_GAP_S, SOAK_S / (len(names) + 1))
        deadline = time.monotonic() + max(SOAK_S, gap * (len(names) + 1))
        while time.monotonic() < deadline:
            victim = names[len(killed) % len(names)]
            if kill(victim):
                killed.append(victim)
            for name, rss in memory_of_service_actors().items():
                peak[name] = max(peak.get(name, 0), rss)
            time.sleep(gap)
    print(f"soak {SOAK_S:.0f} s: {traffic.loads} loads ({traffic.hits} hits), "
          f"{traffic.stores} stores, {len(killed)} kills, slowest call {traffic.slowest:.1f} s; "
          f"peak MiB: { {n: p >> 20 for n, p in sorted(peak.items())} }")
    assert set(names) <= set(killed), f"not killed: {set(names) - set(killed)}"
    assert traffic.wrong == [], traffic.wrong[:5]
    assert traffic.errors == [], traffic.errors[:5]
    assert traffic.slowest < bound_s
    over = {n: p >> 20 for n, p in peak.items() if p > allowance(n, config) + OVERHEAD}
    assert over == {}, f"MiB resident past capacity + {OVERHEAD >> 20} MiB: {over}"
    assert until(lambda: nothing_held(cm, node), config.lease_s + 60), held(cm, node)
    # Served again afterwards, every prefix right.
    for toks, kv in traffic.prefixes:
        assert until(lambda t=toks, k=kv: traffic.ns.store(t, k).wait() >= 0
                     and torch.equal(traffic.ns.load(t), k), 60), "not served after the soak"
