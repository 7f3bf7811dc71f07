"""The directory on hosts other than its client's: a pulled cable, and a host that loses power.

A cluster of its own, in a process of its own, on hosts (cmx.bench.harness.hosts): host A (the head,
the driver, the client) and hosts B and C, labelled ``directory_label``, so the service starts
its two directory shards there and none on A (actors/directory/placement.py). Prompts stored
from A are found through the shards on B and C and load exact; so does a prefix held only on
C. With B's cable down, A's lookups stop at the first block whose shard is on B (a miss,
never a wrong copy) within their bound, and what A holds loads whole; with the cable back,
lookups are whole again. With every process of B killed, B's shard (pinned to B, so Ray
cannot restart it) is started again by the controller on C, the labelled host left; the
tiers resync it, and lookups find every block again; a load from C through it is exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hosts_support import no_hosts, on_hosts
from lifecycle_support import new_machine

pytestmark = pytest.mark.hosts

CALL_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 8.0
# A lookup waits for each shard in turn, a load for a lookup and its windows: slack for a
# busy machine on top.
BOUND_S = 3 * LOAD_TIMEOUT_S
BLOCKS = 6  # per prefix
PROMPTS = 3  # stored from A

SCENARIO = """
import json, sys, time, ray
sys.path.insert(0, sys.argv[2])
from hosts_scenario import Far, timed_load
from pool_support import until
from cmx import ContextMemory, KVLayout
from cmx.bench.harness.hosts import Hosts
from cmx.config import ServiceConfig
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.protocol import shard_of

call_s, load_s = float(sys.argv[3]), float(sys.argv[4])
blocks, n_prompts = int(sys.argv[5]), int(sys.argv[6])
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=64)
block = layout.block_bytes
config = ServiceConfig(block_bytes=block, hbm_bytes=16 * block, dram_bytes=64 * block,
                       nvme_bytes=128 * block, nvme_segment_bytes=32 * block,
                       nvme_dir=sys.argv[1], directory_shards=2, transport="nixl",
                       call_timeout_s=call_s, load_timeout_s=load_s, heartbeat_s=0.5,
                       staging_bytes=16 * block)
hosts = Hosts(head_node_args={"num_cpus": 2}, private_dirs=(sys.argv[1],))
# B and C join first, labelled, so the service starts its shards there and none on A.
far_hosts = {h: hosts.add_node(num_cpus=1, name=h, labels={config.directory_label: "1"})
             for h in ("b", "c")}
cm = ContextMemory.connect(address=hosts.address, config=config)
ns = cm.namespace("m", layout)
names = {cm.node_id: "a", **{h.node_id: name for name, h in far_hosts.items()}}
out = {}


def placed(shard):
    try:
        actor = ray.get_actor(actor_name("dir", shard), namespace=RAY_NAMESPACE)
        return names.get(ray.get(actor.placed_on.remote(), timeout=call_s), "another")
    except Exception:
        return None


def timed_lookup(tokens):
    start = time.monotonic()
    match = ns.lookup(tokens)
    return {"blocks": len(match.blocks), "s": time.monotonic() - start,
            "nodes": sorted({names.get(c.node, c.node) for b in match.blocks for c in b.copies})}


def whole(tokens):
    return len(ns.lookup(tokens).blocks) * layout.block_tokens == len(tokens)


# A shard whose start came before Ray's scheduler knew its node is started again.
out["up"] = until(lambda: None not in [placed(i) for i in range(2)], 120)
out["shards"] = [placed(i) for i in range(2)]
b_shard = out["shards"].index("b")
far = Far(far_hosts["c"].node_id, config, layout)
out["c_name"] = far.hostname
# What A stores, held on A; and prefixes held only on C, each loaded from A in one phase only
# (a load leaves a copy on A).
mine = [list(range(i * 10_000, i * 10_000 + blocks * 64)) for i in range(n_prompts)]
kv_mine = [layout.random_kv(len(t), seed=10 + i) for i, t in enumerate(mine)]
out["stored"] = [ns.store(t, kv).wait() for t, kv in zip(mine, kv_mine)]
on_c = {phase: far.store(ns, 100_000 + i * 10_000, blocks, seed=20 + i)
        for i, phase in enumerate(("whole", "cut", "back", "killed"))}
out["on_c"] = {phase: held[2:] for phase, held in on_c.items()}
# Where each prompt's lookup must stop while B's shard answers nothing: its first key there.
out["until_b"] = [next((i for i, k in enumerate(ns.keys(t)) if shard_of(k, 2) == b_shard),
                       blocks) for t in mine + [on_c["cut"][0]]]


def phase(name):
    out[name] = {"mine": [timed_load(ns, t, kv) for t, kv in zip(mine, kv_mine)],
                 "lookups": [timed_lookup(t) for t in mine]}
    if name in on_c:
        out[name]["from_c"] = timed_load(ns, *on_c[name][:2])


phase("whole")
hosts.link(far_hosts["b"], up=False)
phase("cut")
hosts.link(far_hosts["b"], up=True)
out["whole_again"] = until(lambda: all(whole(t) for t in mine + [on_c["back"][0]]), 120)
phase("back")
hosts.kill_host(far_hosts["b"])
phase("at_kill")
out["shard_back"] = until(lambda: placed(b_shard) not in (None, "b"), 300)
out["shards_after"] = [placed(i) for i in range(2)]
out["found_again"] = until(lambda: all(whole(t) for t in mine + [on_c["killed"][0]]), 240)
phase("killed")
cm.shutdown(stop_service=True)
ray.shutdown()
hosts.shutdown()
print(json.dumps(out))
"""


def exact(load: dict[str, object], tokens: int) -> bool:
    return load["tokens"] == tokens and load["right"] is True and float(load["s"]) < BOUND_S


@pytest.mark.timeout(900)
def test_directory_shards_on_other_hosts_answer_misses_when_cut_and_come_back(
        tmp_path: Path) -> None:
    why = no_hosts()
    if why is not None:
        pytest.skip(f"needs hosts of their own: {why}")
    m = new_machine(tmp_path, with_token=False)
    nvme = tmp_path / "nvme-dir-hosts"
    out = on_hosts(m, SCENARIO, str(nvme), str(Path(__file__).parent), str(CALL_TIMEOUT_S),
                   str(LOAD_TIMEOUT_S), str(BLOCKS), str(PROMPTS), timeout_s=840)
    print(out)  # shown where an assertion fails
    whole = BLOCKS * 64
    assert out["up"] is True
    assert sorted(out["shards"]) == ["b", "c"]  # the directory on B and C, none on A
    assert out["c_name"] == "c" and out["stored"] == [BLOCKS] * PROMPTS
    assert out["on_c"] == {p: [BLOCKS, True] for p in ("whole", "cut", "back", "killed")}
    # Whole: found through the shards on B and C, each copy where it was stored; exact.
    for p in ("whole", "back", "killed"):
        assert all(exact(load, whole) for load in out[p]["mine"]), out[p]
        assert exact(out[p]["from_c"], whole), out[p]
    for p in ("whole", "back"):
        assert out[p]["lookups"] == [{**x, "blocks": BLOCKS, "nodes": ["a"]}
                                     for x in out[p]["lookups"]]
    # B cut: each lookup stops at its first block whose shard is on B, within the bound; what
    # A holds loads whole; C's prefix loads exact as far as it was found.
    *until_b, until_b_c = out["until_b"]
    assert any(n < BLOCKS for n in until_b)  # the cut cost some lookup blocks
    for lookup, n in zip(out["cut"]["lookups"], until_b):
        assert lookup["blocks"] == n and lookup["s"] < BOUND_S, lookup
        assert lookup["nodes"] == (["a"] if n else [])
    assert all(exact(load, whole) for load in out["cut"]["mine"]), out["cut"]
    from_c = out["cut"]["from_c"]
    assert from_c["right"] is True and from_c["tokens"] <= until_b_c * 64, from_c
    assert from_c["s"] < BOUND_S
    assert out["whole_again"] is True
    # B killed: a miss at worst, within the bound, and A's own blocks load whole.
    for lookup in out["at_kill"]["lookups"]:
        assert lookup["s"] < BOUND_S and lookup["nodes"] in ([], ["a"]), lookup
    assert all(exact(load, whole) for load in out["at_kill"]["mine"]), out["at_kill"]
    # B's shard comes back on a live host, is resynced, and finds every block again.
    assert out["shard_back"] is True
    assert out["shards_after"] == ["c", "c"]  # on the labelled host left
    assert out["found_again"] is True
    assert out["killed"]["lookups"] == [{**x, "blocks": BLOCKS, "nodes": ["a"]}
                                        for x in out["killed"]["lookups"]]
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
