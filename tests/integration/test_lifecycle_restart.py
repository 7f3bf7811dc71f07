"""A node keeps its disk: data written through to NVMe is found again, byte for byte, after the
embedded cluster restarts (new Ray node ids); an old store directory nobody claims is listed as
an orphan and collected by the admin action; the blocks keep their namespace, so a namespace drop
after the restart finds them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lifecycle_support import new_machine

PHASE = """
import json, time, torch
from collections import Counter
from cmx import ContextMemory, KVLayout
from cmx.operate.orphans import collect_orphans, list_orphans
from cmx.tiers import Tier

layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
blocks = 24
tokens = list(range(blocks * 16))
kv = torch.randn(layout.shape(len(tokens)), generator=torch.Generator().manual_seed(7))
kv = kv.to(torch.float16)
cm = ContextMemory.connect(num_cpus=1, include_dashboard=False)
ns = cm.namespace("m", layout)

def nvme():
    return cm.stats().nodes[cm.node_id].tiers[Tier.NVME]

def until(done, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.5)

out = {"node": cm.node_id}
if PHASE == 1:
    out["stored"] = ns.store(tokens, kv).wait()
    until(lambda: nvme().blocks >= blocks)
else:
    until(lambda: ns.lookup(tokens).num_tokens >= len(tokens))
    match = ns.lookup(tokens)
    out["found"] = match.num_tokens
    out["tiers"] = dict(Counter(b.tier.value for b in match.blocks))
    out["exact"] = bool(torch.equal(ns.load(tokens), kv))
    out["orphans"] = sorted({o.name for found in list_orphans().values() for o in found})
    out["orphan_dirs"] = nvme().disk.orphan_dirs
    out["collected"] = sorted({o.name for r in collect_orphans().values() for o in r})
    out["dropped"] = cm.drop_namespace(ns.namespace)  # found by the tag kept on disk
    out["found_after_drop"] = ns.lookup(tokens).num_tokens
out["nvme_blocks"] = nvme().blocks
out["store_id"] = nvme().disk.store_id
cm.shutdown()
print(json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_written_through_blocks_are_found_again_after_the_cluster_restarts(
    tmp_path: Path,
) -> None:
    m = new_machine(tmp_path, with_token=False)
    m.env.update({"CMX_PLACEMENT": "write_through", "RAY_ADDRESS": ""})
    first = m.python("PHASE = 1\n" + PHASE, timeout_s=300)
    assert first["stored"] == 24 and first["nvme_blocks"] == 24

    old = tmp_path / "nvme" / "0123456789abcdef"  # named by a Ray node id: the old layout
    old.mkdir()
    (old / "seg-000001.dat").write_bytes(b"\0" * 4096)

    second = m.python("PHASE = 2\n" + PHASE, timeout_s=300)
    assert second["node"] != first["node"]  # a new Ray node id ...
    assert second["store_id"] == first["store_id"]  # ... on the same store
    assert second["found"] == 24 * 16 and second["tiers"] == {"nvme": 24}
    assert second["exact"] is True
    assert second["orphans"] == ["0123456789abcdef"] and second["orphan_dirs"] == 1
    assert second["collected"] == ["0123456789abcdef"] and not old.exists()
    # The blocks kept their namespace on disk: a drop after the restart finds and drops them.
    # (24 on NVMe, and the copies the load above made in HBM and DRAM)
    assert second["dropped"] >= 24 and second["found_after_drop"] == 0
    assert second["nvme_blocks"] == 0
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == [
        f"node-{first['store_id']}", f"node-{first['store_id']}.claim"]
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
