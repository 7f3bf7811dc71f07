"""Figures of suite "service": a prefix living only on this node's NVMe tier.

- Load: ``NamespaceClient.load`` of a 512 MiB and a 2 GiB prefix of 2 MiB and of 32 MiB blocks
  whose HBM and DRAM copies were evicted (page cache dropped where allowed), against fio's
  O_DIRECT sequential read of the same number of bytes (I/Os of one block, QD16) in the same
  repetition.
  Beside it, the agent's part alone: its loads into HBM, window by window as the client asks.
- Store: the same prefix stored through ``ContextMemory`` with write-through placement (the
  store returns once the blocks are committed on NVMe, durable), in calls of at most 512 MiB,
  against fio writing the same bytes into a new file and fsyncing it.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cmx.bench.harness.baselines import fio_engine, fio_path
from cmx.bench.harness.cluster import bench_cluster
from cmx.bench.harness.core import GB, BenchContext, Figure, GiB, Goal, MiB, median
from cmx.client.loads import load_window
from cmx.config import ServiceConfig
from cmx.doors import AgentStatsOf, Evict
from cmx.errors import CmxError
from cmx.layout import KVLayout
from cmx.stats import Unreachable

__all__ = ["nvme_prefix_figures"]

# 128 KiB of KV per token: 16 tokens make 2 MiB, 256 make 32 MiB.
LAYOUTS = {2 * MiB: 16, 32 * MiB: 256}
PREFIXES = (512 * MiB, 2 * GiB)
CHUNK = 512 * MiB  # bytes per store call: bounds the client's memory
GOAL = 0.8


def _layout(block_tokens: int) -> KVLayout:
    return KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16",
                    block_tokens=block_tokens)


def fio_same_bytes(ctx: BenchContext, rw: str, bs: int, nbytes: int) -> float:
    """Bytes/s of fio moving exactly ``nbytes`` with O_DIRECT, ``bs`` I/Os at QD16: a write
    into a new file then fsync, or a read of a file laid out with those bytes."""
    path = ctx.scratch("fio-same") / f"{nbytes}.dat"
    if rw == "write":
        path.unlink(missing_ok=True)
    elif not path.exists():
        _fio_run(ctx, path, "write", MiB, nbytes, fsync=True)
    if rw == "read":
        ctx.drop_cache()
    bw = _fio_run(ctx, path, rw, bs, nbytes, fsync=rw == "write")
    if rw == "write":
        path.unlink(missing_ok=True)
    return bw


def _fio_run(ctx: BenchContext, path: Path, rw: str, bs: int, nbytes: int, fsync: bool) -> float:
    import json

    cmd = [fio_path(), "--name=same", f"--filename={path}", f"--size={nbytes}", "--direct=1",
           f"--ioengine={fio_engine(ctx)}", f"--rw={rw}", f"--bs={bs}", "--iodepth=16",
           "--numjobs=1", "--output-format=json"] + (["--end_fsync=1"] if fsync else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CmxError(f"fio failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    return float(job[rw]["bw_bytes"])


@dataclass(frozen=True)
class StoreSplit:
    """Where a store of the prefix went, in seconds: the writer's side (``StoreTimes`` of
    each call, and its final wait) and the agent's (sums of its latency histograms)."""

    total_s: float
    writer_cpu_s: float  # CPU seconds of the writer's process over the store
    grant_and_copy_s: float  # writer: grants, copy into DRAM slots, checksums
    commit_wait_s: float  # writer: waiting for an earlier window's commit, or the last
    agent_grant_s: float  # agent: DRAM reservations and what they evict, demoted
    agent_commit_s: float  # agent: commit_store, write-through included
    nvme_write_s: float  # agent: the NVMe writes' bytes, within commit_store
    nvme_books_s: float  # agent: the NVMe tier's reserve and commit (flush) around them

    def describe(self, nbytes: int) -> str:
        return (f"store {self.total_s:.2f} s (writer's CPU {self.writer_cpu_s:.2f} s): "
                f"writer's grants + copy into slots "
                f"{self.grant_and_copy_s:.2f} s, waiting for commits {self.commit_wait_s:.2f} s; "
                f"agent's grants {self.agent_grant_s:.2f} s, commits {self.agent_commit_s:.2f} s "
                f"(NVMe writes {self.nvme_write_s:.2f} s = {nbytes / self.nvme_write_s / GB:.2f} "
                f"GB/s, NVMe reserve + commit with flush {self.nvme_books_s:.2f} s)"
                if self.nvme_write_s > 0 else f"store {self.total_s:.2f} s")


def _agent_sums(cm: Any) -> dict[str, float]:
    from cmx.links import actor_name

    hist = cm.link.call(actor_name("agent", cm.node_id), AgentStatsOf()).latency
    return {op: h.sum for op, h in hist.items()}


def _store(cm: Any, layout: KVLayout, nbytes: int, kv: Any) -> tuple[Any, Any, StoreSplit]:
    """Store a fresh prefix of ``nbytes``; (namespace, token ids, where its time went)."""
    import numpy as np

    ns = cm.namespace("bench-nvme", layout, uuid.uuid4().hex[:8])
    blocks = nbytes // layout.block_bytes
    T, per_call = layout.block_tokens, CHUNK // layout.block_bytes
    toks = np.random.default_rng(blocks).integers(0, 100_000, blocks * T)
    before = _agent_sums(cm)
    copying = waiting = 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    for first in range(0, blocks, per_call):
        n = min(per_call, blocks - first)
        handle = ns.store(toks[: (first + n) * T], kv[:, :, :, : n * T], start=first * T)
        t1 = time.perf_counter()
        if handle.wait() != n:
            raise AssertionError(f"stored fewer than {n} blocks")
        waiting += handle.times.commit_wait_s + time.perf_counter() - t1
        copying += handle.times.grant_and_copy_s
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = _agent_sums(cm)
    d = {op: after.get(op, 0.0) - before.get(op, 0.0) for op in after}
    return ns, toks, StoreSplit(total, cpu, copying, waiting, d.get("grant_store", 0.0),
                                d.get("store", 0.0), d.get("nvme_write", 0.0),
                                d.get("nvme_books", 0.0))


def _only_on_nvme(cm: Any, ns: Any, toks: Any) -> None:
    from cmx.links import actor_name
    from cmx.tiers import Tier

    keys = [b.key for b in ns.lookup(toks).blocks]
    for tier in ("hbm", "dram"):
        cm.link.call(actor_name(tier, cm.node_id), Evict(keys=keys))
    where = [{c.tier for c in b.copies if c.node == cm.node_id} for b in ns.lookup(toks).blocks]
    if len(where) != len(keys) or any(w != {Tier.NVME} for w in where):
        raise AssertionError("the prefix is not on this node's NVMe tier alone")


def _load_seconds(cm: Any, ns: Any, toks: Any) -> tuple[float, float]:
    """Seconds of one load, and the CPU seconds this (the client's) process spent in it: its
    copy out and checks, which a machine busy with other work stretches in wall time."""
    c0, t0 = time.process_time(), time.perf_counter()
    got = ns.load(toks)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if got.shape[3] != len(toks):
        tiers = cm.stats().nodes[cm.node_id].tiers
        held = {t: s if isinstance(s, Unreachable) else
                (s.blocks, s.pinned, s.reserved, s.leases.expired) for t, s in tiers.items()}
        raise AssertionError(f"loaded {got.shape[3]} of {len(toks)} tokens; tiers then: {held}")
    return dt, cpu


def _agent_seconds(cm: Any, ns: Any, toks: Any) -> float:
    """Seconds the agent takes to load the prefix into HBM, window by window as the client
    asks (``cmx.client.loads``' windows), without the client's checksum and copy out."""
    import ray

    from cmx.links import RAY_NAMESPACE, actor_name

    agent = ray.get_actor(actor_name("agent", cm.node_id), namespace=RAY_NAMESPACE)
    hbm = ray.get_actor(actor_name("hbm", cm.node_id), namespace=RAY_NAMESPACE)
    blocks = list(ns.lookup(toks).blocks)
    window = load_window(cm.config)
    took = 0.0
    for start in range(0, len(blocks), window):
        chunk = blocks[start : start + window]
        keys, copies = [b.key for b in chunk], [list(b.copies) for b in chunk]
        t0 = time.perf_counter()
        got: Any = ray.get(agent.load.remote(keys, copies))
        took += time.perf_counter() - t0
        ray.get(agent.release.remote([b.lease for b in got.blocks]))
        if len(got.blocks) != len(chunk):
            raise AssertionError(f"the agent loaded {len(got.blocks)} of {len(chunk)} blocks")
    ray.get(hbm.evict.remote([b.key for b in blocks]))
    return took


def nvme_prefix_figures(ctx: BenchContext) -> tuple[list[Figure], list[str]]:
    """The figures, and notes on block sizes whose cluster did not start (a loaded machine:
    the other block size's figures are kept)."""
    figures: list[Figure] = []
    notes: list[str] = []
    for block_bytes, block_tokens in LAYOUTS.items():
        try:
            figures += _figures_of(ctx, block_bytes, block_tokens)
        except Exception as exc:  # noqa: BLE001 - one cluster's failure costs only its figures
            ctx.log(f"service: {block_bytes // MiB} MiB blocks failed: {exc}")
            notes.append(f"NVMe prefix of {block_bytes // MiB} MiB blocks: no figures, "
                         f"{type(exc).__name__}: {exc}")
    return figures, notes


def _figures_of(ctx: BenchContext, block_bytes: int, block_tokens: int) -> list[Figure]:
    figures = []
    layout = _layout(block_tokens)
    config = ServiceConfig(
        block_bytes=block_bytes, hbm_bytes=GiB, dram_bytes=GiB // 2,
        nvme_bytes=8 * GiB, nvme_segment_bytes=GiB, placement="write_through",
        nvme_dir=str(ctx.scratch("service-nvme")), load_timeout_s=300)
    kv = layout.random_kv(CHUNK // layout.block_bytes * block_tokens, seed=block_bytes)
    with bench_cluster(config) as bc:
        for nbytes in PREFIXES:
            loads, agent, stores, fio_r, fio_w = [], [], [], [], []
            splits: list[StoreSplit] = []
            client_cpu: list[float] = []
            for rep in range(ctx.config.reps):
                ctx.log(f"service: {nbytes // MiB} MiB prefix of {block_bytes // MiB} MiB "
                        f"blocks on NVMe, rep {rep + 1}/{ctx.config.reps}")
                fio_w.append(fio_same_bytes(ctx, "write", block_bytes, nbytes) / GB)
                ns, toks, split = _store(bc.cm, layout, nbytes, kv)
                stores.append(nbytes / split.total_s / GB)
                splits.append(split)
                fio_r.append(fio_same_bytes(ctx, "read", block_bytes, nbytes) / GB)
                _only_on_nvme(bc.cm, ns, toks)
                ctx.drop_cache()
                wall, cpu = _load_seconds(bc.cm, ns, toks)
                loads.append(nbytes / wall / GB)
                client_cpu.append(cpu)
                _only_on_nvme(bc.cm, ns, toks)
                ctx.drop_cache()
                agent.append(nbytes / _agent_seconds(bc.cm, ns, toks) / GB)
                ctx.log(f"service: load {loads[-1]:.2f} GB/s (client CPU {client_cpu[-1]:.2f} s), "
                        f"agent alone {agent[-1]:.2f}, fio read {fio_r[-1]:.2f}")
                ctx.log(f"service: store {stores[-1]:.2f} GB/s, fio write {fio_w[-1]:.2f}; "
                        f"{split.describe(nbytes)}")
            what = f"{nbytes // MiB} MiB prefix of {block_bytes // MiB} MiB blocks"
            figures += [
                Figure("service", f"ContextMemory.load, {what}, on local NVMe only", "GB/s",
                       tuple(loads), f"fio read, same bytes, bs {block_bytes // MiB} MiB "
                       f"QD16 O_DIRECT", tuple(fio_r), Goal(">=", GOAL),
                       note=f"the agent's part alone (into HBM, before the client's "
                            f"checksum and copy out): {median(agent):.2f} GB/s; the client's "
                            f"CPU time per load (copy out, checks, calls): "
                            f"{median(client_cpu):.2f} s"),
                Figure("service", f"ContextMemory store, write-through, {what}", "GB/s",
                       tuple(stores), f"fio write, same bytes into a new file + fsync, bs "
                       f"{block_bytes // MiB} MiB QD16 O_DIRECT", tuple(fio_w),
                       Goal(">=", GOAL), note="store calls of at most 512 MiB; " + "; ".join(
                           f"rep {i + 1}: {sp.describe(nbytes)}" for i, sp in enumerate(splits))),
            ]
    return figures
