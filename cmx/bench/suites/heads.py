"""Suite "heads": one KV head of eight through the service, against a whole-block load, per tier.

The access of head-wise offloading (one KV head resident at a time): ``ns.load(tokens,
heads=h)`` against ``ns.load(tokens)`` of the same prefix, from each place a block can be:

- Geometry: 32 layers, 8 KV heads, head_dim 128, bfloat16, 32-token blocks (4 MiB), in the
  head-major payload order, where one head of a block is one 512 KiB run. The prefix is 16
  blocks (64 MiB); one head of it is 8 MiB.
- Tiers, in the order measured: a peer's DRAM (the loads run on node b, the blocks are on
  node a), then node a's HBM, DRAM, NVMe, and the pool (one pool node). Before each load the
  copies a whole load leaves in the loading node's tiers are evicted, so every repetition
  reads from the tier named; NVMe and pool reads drop the page cache where allowed. From
  the peer and the pool the one-head load moves only the head's byte ranges over NIXL (one
  READ of many descriptors per window), the whole load whole slots: the table says how many
  bytes crossed over NIXL in each.
- A figure is the median time of the one-head load over the median time of the whole load
  (goal: at most half). Each tier's one-head load is checked once against the slice of the
  whole load. The notes give the bytes each load moved (the agents' counters); the report
  gives the machine's load average, as for every suite.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any, cast

import numpy as np

from cmx.bench.harness.cluster import bench_cluster, on_node
from cmx.bench.harness.core import BenchContext, Figure, Goal, MiB, SuiteResult, Table, median
from cmx.config import ServiceConfig
from cmx.doors import AgentStatsOf, DropStaging, Evict
from cmx.layout import KVLayout, PayloadOrder

__all__ = ["run_heads"]

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                  block_tokens=32, order=PayloadOrder.HEAD_MAJOR)
BLOCKS = 16
HEAD = 3
STAGING = 4  # blocks of the pool node's staging arena: a pool write takes at most that many


class _Loader:
    """A client on one node that times its own loads, evicting its node's copies first."""

    def __init__(self, config: ServiceConfig) -> None:
        from cmx.client import ContextMemory

        self.cm = ContextMemory.connect(config=config, start_service=False)

    def node(self) -> str:
        return str(self.cm.node_id)

    def timed(self, salt: str, toks: np.ndarray, heads: int | None,
              evict: tuple[str, ...]) -> tuple[float, Any]:
        from cmx.protocol import actor_name

        ns = self.cm.namespace("bench-heads", LAYOUT, salt)
        keys = ns.keys(toks)
        for tier in evict:
            self.cm.link.call(actor_name(tier, self.cm.node_id), Evict(keys=keys))
        t0 = time.perf_counter()
        got = ns.load(toks) if heads is None else ns.load(toks, heads=heads)
        seconds = time.perf_counter() - t0
        if got.shape[3] != len(toks):
            raise AssertionError(f"loaded {got.shape[3]} of {len(toks)} tokens")
        return seconds, got


def _moved(cm: Any, nodes: list[str]) -> Counter[str]:
    """The agents' bytes moved, by route, and (keys ``via:<transport>``) by how."""
    from cmx.protocol import actor_name

    total: Counter[str] = Counter()
    for node in nodes:
        stats = cm.link.call(actor_name("agent", node), AgentStatsOf())
        total.update(stats.moved_bytes)
        total.update({f"via:{k}": v for k, v in stats.moved_via.items()})
    return total


def _split(delta: Counter[str]) -> tuple[int, int]:
    """(bytes moved, of them between nodes over NIXL) of a counters' difference."""
    return (sum(v for k, v in delta.items() if not k.startswith("via:")),
            delta["via:nixl-ucx"])


def _measure(ctx: BenchContext, cm: Any, loader: Any, salt: str, toks: np.ndarray,
             evict: tuple[str, ...], cold: list[str], nodes: list[str]
             ) -> tuple[list[float], list[float], tuple[int, int], tuple[int, int]]:
    """(whole-load times, one-head times, (bytes, over NIXL) a whole load moved, the same of
    a one-head load)."""
    import ray
    import torch

    from cmx.protocol import actor_name

    def run(heads: int | None) -> tuple[float, Any, tuple[int, int]]:
        ctx.drop_cache()
        for pool in cold:
            cm.link.call(actor_name("pool", pool), DropStaging())
        before = _moved(cm, nodes)
        seconds, got = ray.get(loader.timed.remote(salt, toks, heads, evict))
        after = _moved(cm, nodes)
        return seconds, got, _split(after - before)

    whole, heads = [], []
    moved_whole = moved_head = (0, 0)
    for rep in range(ctx.config.reps):
        seconds, full, moved_whole = run(None)
        whole.append(seconds)
        seconds, one, moved_head = run(HEAD)
        heads.append(seconds)
        if rep == 0 and not torch.equal(one, full[:, :, HEAD : HEAD + 1]):
            raise AssertionError("the one-head load is not the slice of the whole load")
    return whole, heads, moved_whole, moved_head


def run_heads(ctx: BenchContext) -> SuiteResult:
    import ray

    from cmx.protocol import actor_name

    result = SuiteResult("heads", command="")
    block = LAYOUT.block_bytes
    config = ServiceConfig(
        block_bytes=block, hbm_bytes=(2 * BLOCKS + 4) * block,
        dram_bytes=(2 * BLOCKS + 4) * block, nvme_bytes=4 * BLOCKS * block,
        pool_bytes=4 * BLOCKS * block, pool_staging_bytes=STAGING * block,
        pool_admission_min_count=1, pool_replication=1, placement="write_through",
        nvme_dir=str(ctx.scratch("heads")), load_timeout_s=300)
    rows = []
    with bench_cluster(config, pool_nodes=1) as bc:
        cm = bc.cm
        salt = uuid.uuid4().hex[:8]
        ns = cm.namespace("bench-heads", LAYOUT, salt)
        toks = np.random.default_rng(5).integers(0, 100_000, BLOCKS * LAYOUT.block_tokens)
        ctx.log(f"heads: storing {BLOCKS} blocks of {block // MiB} MiB on node a")
        for first in range(0, BLOCKS, STAGING):  # each store's pool write fits the staging
            kv = LAYOUT.random_kv(STAGING * LAYOUT.block_tokens, seed=first)
            ns.store(toks[: (first + STAGING) * LAYOUT.block_tokens], kv,
                     start=first * LAYOUT.block_tokens).wait()
        remote = cast(Any, ray.remote(_Loader))
        on_a = remote.options(num_cpus=0, scheduling_strategy=on_node(bc.node_a)).remote(config)
        on_b = remote.options(num_cpus=0, scheduling_strategy=on_node(bc.node_b)).remote(config)
        nodes = [bc.node_a, bc.node_b]
        local_all = ("hbm", "dram", "nvme")
        plan: list[tuple[str, Any, tuple[str, ...], tuple[str, ...], list[str]]] = [
            # (tier, loader, evict on the loader's node before each load, evict on node a
            #  once before the tier, pool nodes made cold before each load)
            ("peer DRAM", on_b, local_all, ("hbm",), []),
            ("HBM", on_a, (), (), []),
            ("DRAM", on_a, ("hbm",), ("hbm",), []),
            ("NVMe", on_a, ("hbm",), ("hbm", "dram"), []),
            ("pool", on_a, ("hbm",), ("hbm", "dram", "nvme"), bc.pool),
        ]
        for tier, loader, evict, once, cold in plan:
            for t in once:
                cm.link.call(actor_name(t, bc.node_a), Evict(keys=ns.keys(toks)))
            if tier == "HBM":
                ray.get(loader.timed.remote(salt, toks, None, ()))  # leaves a copy in HBM
            ctx.log(f"heads: {tier}, {ctx.config.reps} x (whole, one head)")
            whole, heads, (mw, nw), (mh, nh) = _measure(ctx, cm, loader, salt, toks, evict,
                                                        cold, nodes)
            result.figures.append(Figure(
                "heads", f"one KV head of 8, {BLOCKS} x 4 MiB blocks, from {tier}", "s",
                tuple(heads), "the whole load of the same blocks", tuple(whole),
                Goal("<=", 0.5),
                note=f"the agents moved {mh / MiB:.1f} MiB against {mw / MiB:.1f} MiB"
                     + (f"; over NIXL {nh / MiB:.1f} MiB against {nw / MiB:.1f} MiB"
                        if nw or nh else "")))
            rows.append((tier, f"{median(whole) * 1e3:.1f}", f"{median(heads) * 1e3:.1f}",
                         f"{mw / MiB:.1f}", f"{mh / MiB:.1f}", f"{nw / MiB:.1f}",
                         f"{nh / MiB:.1f}"))
    result.tables.append(Table(
        "one head of eight against the whole block, medians",
        ("tier", "whole ms", "one head ms", "agents moved, whole (MiB)",
         "agents moved, one head (MiB)", "over NIXL, whole (MiB)",
         "over NIXL, one head (MiB)"),
        tuple(rows)))
    return result
