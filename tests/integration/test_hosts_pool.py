"""The pooled NVMe tier (G4) on pool nodes that are hosts of their own.

A cluster of its own, in a process of its own, on hosts (cmx.bench.harness.hosts): host A (the head,
the driver) and pool hosts P1 and P2, each with its own network, /dev/shm and NVMe root, TCP
between them. Blocks stored on A with replication 2 have a copy on each pool host; with A's
own copies evicted, A loads them exact from the pool, over the network. Then every process of
P1 is killed at once: A's loads are never wrong bytes (a call to the dead host fails and the
next copy is tried; a load that runs out of time first is a miss), and once the controller has
seen P1 go they are whole and exact, from P2's replicas.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hosts_support import no_hosts, on_hosts
from lifecycle_support import new_machine
from pool_support import N

pytestmark = pytest.mark.hosts

SCENARIO = """
import json, sys, torch, ray
sys.path.insert(0, sys.argv[2])
from pool_support import N, T, drop_local_copies, prompts, reconcile, until
from support import LAYOUT
from cmx import ContextMemory
from cmx.bench.harness.hosts import Hosts
from cmx.config import ServiceConfig
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.tiers import Tier

block = LAYOUT.block_bytes
config = ServiceConfig(block_bytes=block, hbm_bytes=16 * block, dram_bytes=16 * block,
                       nvme_bytes=64 * block, nvme_segment_bytes=32 * block,
                       nvme_dir=sys.argv[1], directory_shards=1, transport="nixl",
                       call_timeout_s=10.0, load_timeout_s=60.0, heartbeat_s=0.5,
                       staging_bytes=16 * block, pool_bytes=256 * block,
                       pool_staging_bytes=16 * block, pool_replication=2,
                       pool_admission_min_count=1)
hosts = Hosts(head_node_args={"num_cpus": 2}, private_dirs=(sys.argv[1],))
# The service first, so its directory and controller are on A: the pool hosts carry only
# their own node's actors and the pool's.
cm = ContextMemory.connect(address=hosts.address, config=config)
pool = {p: hosts.add_node(num_cpus=0, labels={config.pool_label: p}, name=p)
        for p in ("p1", "p2")}
until(lambda: len(reconcile()["pool"]) == 2, 120)
out = {"members": sorted(reconcile()["pool"]) == sorted(h.node_id for h in pool.values())}
agent = ray.get_actor(actor_name("agent", cm.node_id), namespace=RAY_NAMESPACE)
ns = cm.namespace("m-pool", LAYOUT, "hosts", replication=2)
toks = prompts(31)
kvs = [LAYOUT.random_kv(T, seed=300 + i) for i in range(N)]
out["stored"] = sum(ns.store(t, kv).wait() for t, kv in zip(toks, kvs))
out["pool_nodes"] = sorted({len({c.node for c in ns.lookup(t).blocks[0].copies
                                 if c.tier is Tier.POOL}) for t in toks})


def from_pool():
    return ray.get(agent.stats.remote(), timeout=60).moved_bytes.get("pool@peer->hbm", 0)


def loads():
    got = [ns.load(t) for t in toks]
    return {"whole": sum(g.shape[3] == T for g in got),
            "wrong": sum(g.shape[3] > 0 and not torch.equal(g, kv) for g, kv in zip(got, kvs))}


drop_local_copies(cm, ns, toks)  # only the pool hosts hold them now
before = from_pool()
out["loaded"] = loads()
out["loaded_from_pool"] = from_pool() - before
drop_local_copies(cm, ns, toks)
hosts.kill_host(pool["p1"])
out["at_kill"] = loads()
out["p1_gone"] = until(lambda: pool["p1"].node_id not in reconcile()["pool"], 180)
drop_local_copies(cm, ns, toks)
before = from_pool()
out["after"] = loads()
out["after_from_pool"] = from_pool() - before
out["block"] = block
cm.shutdown(stop_service=True)
ray.shutdown()
hosts.shutdown()
print(json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_pool_replicas_on_hosts_of_their_own_survive_a_dead_pool_host(tmp_path: Path) -> None:
    why = no_hosts()
    if why is not None:
        pytest.skip(f"needs hosts of their own: {why}")
    m = new_machine(tmp_path, with_token=False)
    nvme = tmp_path / "nvme-pool-hosts"
    out = on_hosts(m, SCENARIO, str(nvme), str(Path(__file__).parent), timeout_s=840)
    n, block = N, out["block"]
    assert out["members"] is True and out["stored"] == n
    assert out["pool_nodes"] == [2]  # each block has a copy on each pool host
    assert out["loaded"] == {"whole": n, "wrong": 0}
    assert out["loaded_from_pool"] == n * block  # every byte from the pool hosts
    assert out["at_kill"]["wrong"] == 0  # a miss at worst while P1's death is news
    assert out["p1_gone"] is True
    assert out["after"] == {"whole": n, "wrong": 0}
    assert out["after_from_pool"] == n * block  # from P2, the surviving replica
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
