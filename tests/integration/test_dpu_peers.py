"""A node whose agent is on a DPU (``dpu_access="nixl"``) on the cluster's peer path.

A cluster of its own, in a process of its own, each node on a host of its own where namespaces
can be made (cmx.bench.harness.hosts): host A with its DPU, and host B. A's agent
runs on the DPU in a process that refuses to map host memory or open host files. B loads a
prefix that lives only on A, one head of it and then whole (B's transport reads A's host
memory, as A's host endpoint registered it with NIXL), and A loads a prefix that lives only
on B (A's DPU pulls it into memory of its own, checks it, and writes it to A's host HBM over
NIXL): exact bytes both ways, and the DPU's process still maps no host arena.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
from hosts_support import on_hosts
from lifecycle_support import new_machine

pytestmark = pytest.mark.hosts

SCENARIO = """
import dataclasses, json, os, time, sys, torch, ray
from cmx.bench.harness.hosts import hosts_or_local
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from cmx import ContextMemory, KVLayout
from cmx.config import ServiceConfig
from cmx.links import RAY_NAMESPACE, actor_name

layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=64)
block = layout.block_bytes
config = ServiceConfig(block_bytes=block, hbm_bytes=16 * block, dram_bytes=16 * block,
                       nvme_bytes=64 * block, nvme_segment_bytes=32 * block,
                       nvme_dir=sys.argv[1], directory_shards=1, dpu_access="nixl",
                       transport="nixl", call_timeout_s=60, load_timeout_s=120,
                       heartbeat_s=0.5, staging_bytes=16 * block)
c, out_hosts = hosts_or_local(head_node_args={
    "num_cpus": 2, "labels": {config.host_label: "a"}}, private_dirs=(sys.argv[1],))
dpu = c.add_node(num_cpus=0, labels={config.dpu_label: "bluefield-3", config.host_label: "a"})
b_node = c.add_node(num_cpus=1, labels={config.host_label: "b"})
c.wait_for_nodes()
cm = ContextMemory.connect(address=c.address, config=config)
a = cm.node_id


class Client:
    def __init__(self, config):
        self.cm = ContextMemory.connect(config=config, start_service=False)
        self.ns = self.cm.namespace("m", layout)

    def node(self):
        return self.cm.node_id

    def store(self, tokens, kv):
        return self.ns.store(tokens, kv).wait()

    def load_exact(self, tokens, kv):
        return bool(torch.equal(self.ns.load(tokens), kv))

    def load_head(self, tokens, kv):
        return bool(torch.equal(self.ns.load(tokens, heads=1), kv[:, :, 1:2]))


far = ray.remote(Client).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
    b_node.node_id, soft=False)).remote(config)
b = ray.get(far.node.remote(), timeout=120)
agent_a = ray.get_actor(actor_name("agent", a), namespace=RAY_NAMESPACE)
agent_b = ray.get_actor(actor_name("agent", b), namespace=RAY_NAMESPACE)
out = {"placement": ray.get(agent_a.placement.remote(), timeout=60), "dpu": dpu.node_id,
       "block": block}

def prefix(seed, blocks):
    tokens = list(range(seed * 10_000, seed * 10_000 + blocks * 64))
    return tokens, layout.random_kv(blocks * 64, seed=seed)

def nodes_of(ns, tokens):
    return sorted({x.node for x in ns.lookup(tokens).blocks})

ns = cm.namespace("m", layout)
p, kv_p = prefix(1, 6)  # lives only on A
out["stored_p"] = ns.store(p, kv_p).wait()
out["p_on"] = nodes_of(ns, p) == [a]
out["b_head_p"] = ray.get(far.load_head.remote(p, kv_p), timeout=300)  # before a whole load
out["b_loads_p"] = ray.get(far.load_exact.remote(p, kv_p), timeout=300)
q, kv_q = prefix(2, 6)  # lives only on B
out["stored_q"] = ray.get(far.store.remote(q, kv_q), timeout=300)
deadline = time.monotonic() + 60
while nodes_of(ns, q) != [b] and time.monotonic() < deadline:
    time.sleep(0.2)
out["q_on"] = nodes_of(ns, q) == [b]
out["a_loads_q"] = bool(torch.equal(ns.load(q), kv_q))
out["stats_a"] = {k: v for k, v in dataclasses.asdict(
    ray.get(agent_a.stats.remote(), timeout=60)).items()
    if k in ("moved_bytes", "host_access", "transport")}
out["stats_b"] = {k: v for k, v in dataclasses.asdict(
    ray.get(agent_b.stats.remote(), timeout=60)).items()
    if k in ("moved_bytes", "moved_via", "transport")}

def probe(agent_self, names):
    from cmx.storage.arena import SharedArena
    maps = open("/proc/self/maps").read()
    found = {"mapped": [n for n in names if n in maps],
             "in_shm": [n for n in names if os.path.exists("/dev/shm/" + n)]}
    try:
        SharedArena.attach(names[0])
        found["attach"] = "mapped"
    except Exception as exc:
        found["attach"] = type(exc).__name__
    return found

infos = [ray.get(ray.get_actor(actor_name(t, a), namespace=RAY_NAMESPACE).info.remote(),
                 timeout=60) for t in ("hbm", "dram")]
out["probe"] = ray.get(agent_a.__ray_call__.remote(probe, [i.arena for i in infos]),
                       timeout=60)
cm.shutdown(stop_service=True)
ray.shutdown()
c.shutdown()
out["hosts"] = out_hosts
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_a_dpu_node_serves_and_pulls_blocks_between_nodes_over_nixl(tmp_path: Path) -> None:
    m = new_machine(tmp_path, with_token=False)
    nvme = tmp_path / "nvme-dpu-peers"
    out = on_hosts(m, SCENARIO, str(nvme), timeout_s=540)
    assert out["placement"]["placed_on"] == out["dpu"] and out["placement"]["dpu"] is True
    assert out["stored_p"] == 6 and out["p_on"] is True
    assert out["b_head_p"] is True  # one head of two: checked on A's host, read from its memory
    assert out["b_loads_p"] is True  # B read A's host memory, registered by A's endpoint
    assert out["stored_q"] == 6 and out["q_on"] is True
    assert out["a_loads_q"] is True  # A's DPU pulled Q and wrote it to A's host HBM
    block, a, b = out["block"], out["stats_a"], out["stats_b"]
    assert a["host_access"]["name"] == "nixl-dpu"
    assert a["transport"] == b["transport"] == "nixl-ucx"
    assert b["moved_bytes"].get("dram@peer->hbm", 0) == 6 * block
    assert b["moved_bytes"].get("dram@peer->selection", 0) == 6 * block // 2
    assert b["moved_via"].get("nixl-ucx", 0) >= 6 * block
    assert a["moved_bytes"].get("dram@peer->hbm", 0) == 6 * block
    assert a["host_access"]["bounced_from_peers"] == 6 * block
    assert a["host_access"]["bytes_written"] >= 6 * block  # bounce slots to host HBM
    probe = dict(out["probe"])
    in_shm = probe.pop("in_shm")
    assert probe == {"mapped": [], "attach": "HostAccessForbidden"}
    if out["hosts"] is None:  # the DPU is a host of its own: the arenas are not there at all
        assert in_shm == []
    else:
        warnings.warn(f"DPU on this machine ({out['hosts']}): its /dev/shm view is not tested",
                      stacklevel=1)
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
