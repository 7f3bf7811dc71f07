"""An agent on a DPU that reaches its host only over the network (``dpu_access="nixl"``).

A cluster of its own, in a process of its own: a host node and a node labelled as its DPU,
on a host of its own (cmx.bench.harness.hosts: its own network and /dev/shm) where namespaces
can be made. The host's agent runs on the DPU in a process that refuses to map host memory or
open host files; blocks stored through it come back exact from the host's DRAM and, after a
DRAM eviction demoted them, from the host's NVMe, every byte through NIXL; so do one head and
one layer of them (partial loads, checked on the host). The DPU agent's process holds no
mapping of the host's arenas, and an attempt to map one or to open a segment file there raises
HostAccessForbidden.
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
import numpy as np
from cmx.bench.harness.hosts import hosts_or_local
from cmx import ContextMemory, KVLayout
from cmx.config import ServiceConfig
from cmx.links import RAY_NAMESPACE, actor_name

nvme_dir = sys.argv[1]
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=64)
block = layout.block_bytes
config = ServiceConfig(block_bytes=block, hbm_bytes=16 * block, dram_bytes=8 * block,
                       nvme_bytes=256 * block, nvme_segment_bytes=64 * block, nvme_dir=nvme_dir,
                       directory_shards=1, dpu_access="nixl", call_timeout_s=60,
                       load_timeout_s=120, heartbeat_s=0.5, staging_bytes=16 * block)
c, out_hosts = hosts_or_local(head_node_args={
    "num_cpus": 2, "labels": {config.host_label: "h1"}}, private_dirs=(nvme_dir,))
dpu = c.add_node(num_cpus=0, labels={config.dpu_label: "bluefield-3", config.host_label: "h1"})
c.wait_for_nodes()
cm = ContextMemory.connect(address=c.address, config=config)
agent = ray.get_actor(actor_name("agent", cm.node_id), namespace=RAY_NAMESPACE)
out = {"placement": ray.get(agent.placement.remote(), timeout=60), "dpu": dpu.node_id}

def prefix(seed, blocks):
    tokens = list(range(seed * 10_000, seed * 10_000 + blocks * 64))
    return tokens, layout.random_kv(blocks * 64, seed=seed)

ns = cm.namespace("m", layout)
a, kv_a = prefix(1, 4)
out["stored_a"] = ns.store(a, kv_a).wait()
out["dram_tiers"] = sorted({b.tier.value for b in ns.lookup(a).blocks})
out["exact_dram"] = bool(torch.equal(ns.load(a), kv_a))
out["head_dram"] = bool(torch.equal(ns.load(a, heads=1), kv_a[:, :, 1:2]))
b, kv_b = prefix(2, 4)
out["stored_b"] = ns.store(b, kv_b).wait()
c_, kv_c = prefix(3, 8)  # eight more: DRAM's eight slots turn over, b is demoted to NVMe
out["stored_c"] = ns.store(c_, kv_c).wait()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    m = ns.lookup(b)
    if m.num_blocks == 4 and all(x.tier.value == "nvme" for x in m.blocks):
        break
    time.sleep(0.2)
out["nvme_tiers"] = sorted({x.tier.value for x in ns.lookup(b).blocks})
out["layer_nvme"] = bool(torch.equal(ns.load(b, layers=1), kv_b[1:2]))
out["exact_nvme"] = bool(torch.equal(ns.load(b), kv_b))
stats = ray.get(agent.stats.remote(), timeout=60)
out["host_access"] = dataclasses.asdict(stats.host_access)
out["moved"] = dict(stats.moved_bytes)
out["block"] = block

def probe(agent_self, names, path):
    from cmx.storage.arena import SharedArena
    from cmx.storage.nvme.dataplane import Extent
    maps = open("/proc/self/maps").read()
    found = {"mapped": [n for n in names if n in maps],
             "in_shm": [n for n in names if os.path.exists("/dev/shm/" + n)]}
    try:
        SharedArena.attach(names[0])
        found["attach"] = "mapped"
    except Exception as exc:
        found["attach"] = type(exc).__name__
    try:
        agent_self.host.nvme.read_many([Extent(b"k" * 32, path, 0, 4096)],
                                       [np.zeros(4096, np.uint8)])
        found["open"] = "opened"
    except Exception as exc:
        found["open"] = type(exc).__name__
    return found

infos = [ray.get(ray.get_actor(actor_name(t, cm.node_id), namespace=RAY_NAMESPACE)
                 .info.remote(), timeout=60) for t in ("hbm", "dram")]
import glob
segment = sorted(glob.glob(nvme_dir + "/**/*", recursive=True))[-1]
out["probe"] = ray.get(agent.__ray_call__.remote(probe, [i.arena for i in infos], segment),
                       timeout=60)
cm.shutdown(stop_service=True)
ray.shutdown()
c.shutdown()
out["hosts"] = out_hosts
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_a_dpu_agent_moves_every_host_byte_through_nixl(tmp_path: Path) -> None:
    m = new_machine(tmp_path, with_token=False)
    nvme = tmp_path / "nvme-dpu"
    out = on_hosts(m, SCENARIO, str(nvme), timeout_s=500)
    assert out["placement"]["placed_on"] == out["dpu"] and out["placement"]["dpu"] is True
    assert out["stored_a"] == 4 and out["dram_tiers"] == ["dram"]
    assert out["exact_dram"] is True
    assert out["head_dram"] is True  # one head of each block, checked on the host
    assert (out["stored_b"], out["stored_c"]) == (4, 8)
    assert out["nvme_tiers"] == ["nvme"]
    assert out["exact_nvme"] is True
    assert out["layer_nvme"] is True  # one layer, gathered in the host's staging
    access, block = out["host_access"], out["block"]
    assert access["name"] == "nixl-dpu"
    # Stores and the DRAM hit are the client's own copies on the host (its shared memory);
    # what the DPU agent moved: the demotions read at least b's 4 blocks over NIXL before the
    # host wrote them to NVMe, and the NVMe load read b's 4 back to verify them.
    assert access["bytes_read"] >= (4 + 4) * block
    assert out["moved"].get("nvme->hbm", 0) == 4 * block
    probe = dict(out["probe"])
    in_shm = probe.pop("in_shm")
    assert probe == {"mapped": [], "attach": "HostAccessForbidden",
                     "open": "HostAccessForbidden"}
    if out["hosts"] is None:  # the DPU is a host of its own: the arenas are not there at all
        assert in_shm == []
    else:
        warnings.warn(f"DPU on this machine ({out['hosts']}): its /dev/shm view is not tested",
                      stacklevel=1)
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
