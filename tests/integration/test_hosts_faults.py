"""Faults only a network has: a host's cable pulled mid-load, and a host that loses power.

A cluster of its own, in a process of its own, on hosts (cmx.bench.hosts): host A (the head,
the driver) and host B, each with its own network, hostname and /dev/shm, TCP between them.
A prefix lives only on B. With B's cable down, A's loads of it are misses (never wrong
bytes) within their bound; with the cable back, they are whole again. With the cable pulled
while a long prefix is on its way from B (its first blocks landed, the load not returned),
the load returns within the bound with exactly a prefix of what was stored; with the cable
back, the whole prefix loads exact. With every process of B killed at once, A's loads are
misses within the bound and the service goes on serving what A holds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hosts_support import no_hosts, on_hosts
from lifecycle_support import new_machine

pytestmark = pytest.mark.hosts

LOAD_TIMEOUT_S = 8.0
BOUND_S = 3 * LOAD_TIMEOUT_S  # a lookup, the load's own bound, and slack for a busy machine
# The prefix whose load loses its cable: 64 windows of 4 blocks (a quarter of A's HBM tier),
# each a round trip to B, so it is still on its way when the first blocks have landed.
MID_BLOCKS = 256
LEASE_S = 20.0  # a fault's fenced slots come back within two of these

SCENARIO = """
import json, sys, threading, time, ray
sys.path.insert(0, sys.argv[3])
from hosts_scenario import Far, timed_load
from pool_support import until
from cmx import ContextMemory, KVLayout
from cmx.bench.hosts import Hosts
from cmx.config import ServiceConfig
from cmx.links import RAY_NAMESPACE, actor_name

mid_blocks = int(sys.argv[4])
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=64)
block = layout.block_bytes
config = ServiceConfig(block_bytes=block, hbm_bytes=16 * block, dram_bytes=2 * mid_blocks * block,
                       nvme_bytes=4 * mid_blocks * block, nvme_segment_bytes=32 * block,
                       nvme_dir=sys.argv[1], directory_shards=1, transport="nixl",
                       call_timeout_s=30.0, load_timeout_s=float(sys.argv[2]),
                       heartbeat_s=0.5, staging_bytes=16 * block, lease_s=float(sys.argv[5]))
hosts = Hosts(head_node_args={"num_cpus": 2}, private_dirs=(sys.argv[1],))
# The service first, so its directory and controller are on A: B carries only its own node's.
cm = ContextMemory.connect(address=hosts.address, config=config)
b_host = hosts.add_node(num_cpus=1, name="b")
ns = cm.namespace("m", layout)
far = Far(b_host.node_id, config, layout)
out = {"a_name": __import__("socket").gethostname(), "b_name": far.hostname}
agent = ray.get_actor(actor_name("agent", cm.node_id), namespace=RAY_NAMESPACE)
hbm = ray.get_actor(actor_name("hbm", cm.node_id), namespace=RAY_NAMESPACE)


def from_peers():
    moved = ray.get(agent.stats.remote(), timeout=60).moved_bytes
    return sum(n for pair, n in moved.items() if pair.endswith("@peer->hbm"))


def fenced():
    return ray.get(hbm.stats.remote(), timeout=60).fenced_slots


def until_whole(tokens, kv, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while True:
        load = timed_load(ns, tokens, kv)
        if load["tokens"] == len(tokens) or time.monotonic() >= deadline:
            return load
        time.sleep(1)


# Each prefix is loaded here once at most before its fault: a load leaves a copy on A.
p, kv_p, *out["p"] = far.store(ns, 0, 6, seed=3)
out["before"] = timed_load(ns, p, kv_p)
s, kv_s, *out["s"] = far.store(ns, 10_000, 6, seed=4)
hosts.link(b_host, up=False)
out["cut"] = [timed_load(ns, s, kv_s) for _ in range(2)]
hosts.link(b_host, up=True)
out["back"] = until_whole(s, kv_s)
# The cable pulled mid-load: once the first blocks of a long prefix held only on B landed.
q, kv_q, *out["q"] = far.store(ns, 40_000, mid_blocks, seed=6)
moved, mid = from_peers(), {}
loading = threading.Thread(target=lambda: mid.update(timed_load(ns, q, kv_q),
                                                     ended=time.monotonic()))
started = time.monotonic()
loading.start()
while from_peers() == moved and loading.is_alive() and time.monotonic() - started < 120:
    time.sleep(0.01)
hosts.link(b_host, up=False)
pulled = time.monotonic()
out["mid"] = {"moved_at_pull": from_peers() - moved, "pulled_after_s": pulled - started}
loading.join(timeout=300)
out["mid"].update(mid, hung=loading.is_alive(),
                  pulled_before_end=pulled < mid.get("ended", float("inf")))
hosts.link(b_host, up=True)
# The HBM slots of the windows given up while their bytes were on the way are fenced for a
# lease period (a late write lands where no block lies): the prefix loads whole once they
# are back. (Loads asked while they are fenced find HBM short and fence more: not asked.)
out["mid"]["fenced"] = fenced()
out["unfenced"] = until(lambda: fenced() == 0, 6 * config.lease_s)
out["mid_back"] = timed_load(ns, q, kv_q)
r, kv_r, *out["r"] = far.store(ns, 20_000, 6, seed=5)
hosts.kill_host(b_host)
out["killed"] = [timed_load(ns, r, kv_r) for _ in range(2)]
mine = list(range(30_000, 30_000 + 4 * 64))
kv_mine = layout.random_kv(len(mine), seed=4)
out["stored_after"] = ns.store(mine, kv_mine).wait()
out["mine_after"] = timed_load(ns, mine, kv_mine)
out["block"] = block
cm.shutdown(stop_service=True)
ray.shutdown()
hosts.shutdown()
print(json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_a_pulled_cable_and_a_dead_host_are_misses_within_the_bound(tmp_path: Path) -> None:
    why = no_hosts()
    if why is not None:
        pytest.skip(f"needs hosts of their own: {why}")
    m = new_machine(tmp_path, with_token=False)
    nvme = tmp_path / "nvme-hosts"
    out = on_hosts(m, SCENARIO, str(nvme), str(LOAD_TIMEOUT_S), str(Path(__file__).parent),
                   str(MID_BLOCKS), str(LEASE_S), timeout_s=840)
    print(out)  # shown where an assertion fails
    assert out["a_name"] != out["b_name"] == "b"
    assert out["p"] == out["s"] == out["r"] == [6, True]  # each stored on B, held only there
    assert out["q"] == [MID_BLOCKS, True]
    assert out["before"] == {**out["before"], "tokens": 6 * 64, "right": True}
    for load in out["cut"] + out["killed"]:
        assert load["right"] is True  # a shorter prefix (a miss) at worst, never wrong bytes
        assert load["s"] < BOUND_S, load
    assert all(load["tokens"] == 0 for load in out["cut"] + out["killed"])
    assert out["back"] == {**out["back"], "tokens": 6 * 64, "right": True}
    # Mid-load: the cable went after the load started and some of its bytes landed, before
    # the load returned and before all of them had; the load returned within the bound with
    # exactly a prefix of what was stored; with the cable back the whole prefix loads exact.
    mid, whole = out["mid"], MID_BLOCKS * out["block"]
    assert mid["hung"] is False and mid["pulled_before_end"] is True, mid
    assert 0 < mid["moved_at_pull"] < whole, mid
    assert mid["right"] is True and mid["tokens"] <= MID_BLOCKS * 64, mid
    assert mid["s"] < BOUND_S, mid
    assert out["unfenced"] is True
    assert out["mid_back"] == {**out["mid_back"], "tokens": MID_BLOCKS * 64, "right": True}
    assert out["stored_after"] == 4
    assert out["mine_after"] == {**out["mine_after"], "tokens": 4 * 64, "right": True}
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
