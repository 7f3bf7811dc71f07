"""The service's own load times, through the public client API, for the calibration.

Two embedded clusters from the benchmarks' harness (``cmx.bench.cluster``; node "a" stores,
node "b" is another node), one after the other:

- memory: a prefix stored on node a is loaded by a client on node b (its agent pulls it from
  a's DRAM over NIXL), then by the client on node a (from its own DRAM: a's HBM does not have
  it yet, and a's own copy is preferred over b's).
- disk: node a's DRAM holds four slots, so every stored block is demoted to its NVMe
  (write-back) once four more are stored after it; the client on node a loads it from there.

Each repetition stores new prefixes: a load leaves the blocks in the loader's HBM tier, so a
second load of the same prefix would measure HBM. Prefixes of one and of eight tiny blocks
(4 KiB each, in 16 MiB slots) are measured the same way: their time is the control path alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cmx.config import ServiceConfig
from cmx.layout import KVLayout
from cmx.stats import transport_of

__all__ = ["BLOCK_BYTES", "ServiceLoads", "measure_service"]

LARGE = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                 block_tokens=128)
TINY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
BLOCK_BYTES = LARGE.block_bytes  # 16 MiB: two clusters' arenas must fit a shared machine
TINY_SIZES = (1, 8)
# A control call that takes longer is a miss; a machine shared with other work can take that
# long, and a miss would end the calibration.
CALL_TIMEOUT_S = 60.0


@dataclass
class ServiceLoads:
    tiny: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # source -> n -> s
    large: dict[str, list[float]] = field(default_factory=dict)  # source -> s
    baselines: dict[str, list[Any]] = field(default_factory=dict)  # source -> speeds, per rep
    notes: list[str] = field(default_factory=list)
    round_trip_s: list[float] = field(default_factory=list)  # bare Ray actor calls, node a

    def add_tiny(self, source: str, n: int, seconds: float) -> None:
        self.tiny.setdefault(source, {}).setdefault(n, []).append(seconds)

    def add_large(self, source: str, seconds: float, baseline: Any) -> None:
        self.large.setdefault(source, []).append(seconds)
        self.baselines.setdefault(source, []).append(baseline)


def _tokens(layout: KVLayout, blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, blocks * layout.block_tokens)


def _store(cm: Any, layout: KVLayout, blocks: int, seed: int) -> tuple[Any, np.ndarray, Any]:
    """Store a prefix of ``blocks`` blocks on the client's node; returns (ns, tokens, kv of
    its first and last block) for checking what comes back."""
    ns = cm.namespace("calibration", layout, f"s{seed}")
    toks = _tokens(layout, blocks, seed)
    T = layout.block_tokens
    first = last = None
    for start in range(0, blocks, 4):  # bounded memory: 4 blocks of KV at a time
        n = min(4, blocks - start)
        kv = layout.random_kv(n * T, seed=seed * 1000 + start)
        ns.store(toks[: (start + n) * T], kv, start=start * T).wait()
        first = kv[:, :, :, :T].clone() if start == 0 else first
        last = kv[:, :, :, -T:].clone()
    return ns, toks, (first, last)


def _timed_load(ns: Any, toks: np.ndarray, blocks: int, check: Any) -> float:
    t0 = time.perf_counter()
    kv = ns.load(toks)
    seconds = time.perf_counter() - t0
    T = ns.layout.block_tokens
    if kv.shape[3] != blocks * T:
        raise AssertionError(f"loaded {kv.shape[3] // T} of {blocks} blocks")
    first, last = check
    if not (kv[:, :, :, :T].equal(first) and kv[:, :, :, -T:].equal(last)):
        raise AssertionError("a loaded block differs from the one stored")
    return seconds


def _wait_tier(ns: Any, toks: np.ndarray, blocks: int, tier: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = ns.lookup(toks)
        if m.num_blocks == blocks and all(b.tier.value == tier for b in m.blocks):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the prefix did not settle in {tier} within {timeout_s} s")


def _loader_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Loader:
        """A client on another node: its loads go through that node's agent."""

        def __init__(self, config: ServiceConfig) -> None:
            from cmx.client import ContextMemory

            self.cm = ContextMemory.connect(config=config)

        def load(self, layout: KVLayout, seed: int, blocks: int, check: Any) -> float:
            ns = self.cm.namespace("calibration", layout, f"s{seed}")
            return _timed_load(ns, _tokens(layout, blocks, seed), blocks, check)

    return Loader


def _round_trips(node: str, n: int = 100) -> list[float]:
    """Seconds of ``n`` calls to an empty actor method on ``node``: what one hop of the
    control path costs here, to read the tiny loads' costs by."""
    import ray

    from cmx.bench.cluster import on_node

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self) -> None:
            return None

    remote_class: Any = Echo  # ray.remote's: ``options`` is added at run time
    echo = remote_class.options(scheduling_strategy=on_node(node)).remote()
    ray.get(echo.ping.remote(), timeout=CALL_TIMEOUT_S)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(echo.ping.remote(), timeout=CALL_TIMEOUT_S)
        times.append(time.perf_counter() - t0)
    ray.kill(echo)
    return times


def _memory(directory: Path, reps: int, blocks: int, out: ServiceLoads,
            log: Callable[[str], None], baseline: Callable[[], Any]) -> None:
    from cmx.bench.cluster import bench_cluster, on_node

    # DRAM holds every prefix of the run: nothing is evicted, so no disk traffic here.
    config = ServiceConfig(block_bytes=BLOCK_BYTES, hbm_bytes=(2 * blocks + 2) * BLOCK_BYTES,
                           dram_bytes=(reps + 1) * (blocks + sum(TINY_SIZES)) * BLOCK_BYTES,
                           nvme_bytes=4 * BLOCK_BYTES, nvme_dir=str(directory),
                           load_timeout_s=300, call_timeout_s=CALL_TIMEOUT_S)
    with bench_cluster(config) as bc:
        loader = _loader_class().options(scheduling_strategy=on_node(bc.node_b)).remote(
            bc.config)
        import ray

        seed = 100
        ns, toks, check = _store(bc.cm, TINY, 1, seed)  # untimed: NIXL connects, code warms
        ray.get(loader.load.remote(TINY, seed, 1, check))
        _timed_load(ns, toks, 1, check)
        out.round_trip_s = _round_trips(bc.node_a)
        for rep in range(reps):
            log(f"calibration: memory, repetition {rep + 1}/{reps}")
            for n in (*TINY_SIZES, blocks):
                seed += 1
                layout = TINY if n in TINY_SIZES and n != blocks else LARGE
                ns, toks, check = _store(bc.cm, layout, n, seed)
                speeds = baseline() if layout is LARGE else None
                peer = ray.get(loader.load.remote(layout, seed, n, check))
                local = _timed_load(ns, toks, n, check)
                if layout is LARGE:
                    out.add_large("dram@peer", peer, speeds)
                    out.add_large("dram", local, speeds)
                else:
                    out.add_tiny("dram@peer", n, peer)
                    out.add_tiny("dram", n, local)
        via = transport_of(bc.cm.stats(), bc.node_b)
        out.notes.append(f"peer loads through node b's agent, transport {via}")


def _disk(directory: Path, reps: int, blocks: int, out: ServiceLoads,
          log: Callable[[str], None], baseline: Callable[[], Any]) -> None:
    from cmx.bench.cluster import bench_cluster

    per_rep = blocks + sum(TINY_SIZES) + 4
    config = ServiceConfig(block_bytes=BLOCK_BYTES, hbm_bytes=(2 * blocks + 2) * BLOCK_BYTES,
                           dram_bytes=4 * BLOCK_BYTES, placement="write_back",
                           nvme_bytes=(reps + 1) * per_rep * BLOCK_BYTES + 64 * BLOCK_BYTES,
                           nvme_dir=str(directory), load_timeout_s=300,
                           call_timeout_s=CALL_TIMEOUT_S)
    with bench_cluster(config) as bc:
        seed = 500
        for rep in range(reps + 1):  # the first is a warm-up
            log(f"calibration: disk, repetition {rep}/{reps}" + (" (warm-up)" if not rep else ""))
            stored = []
            for n in (*TINY_SIZES, blocks):
                seed += 1
                layout = TINY if n in TINY_SIZES and n != blocks else LARGE
                stored.append((n, layout, *_store(bc.cm, layout, n, seed)))
            seed += 1
            _store(bc.cm, TINY, 4, seed)  # four more: the DRAM's four slots turn over
            for n, _, ns, toks, _ in stored:
                _wait_tier(ns, toks, n, "nvme")
            speeds = baseline() if rep else None
            for n, layout, ns, toks, check in stored:
                seconds = _timed_load(ns, toks, n, check)
                if rep and layout is LARGE:
                    out.add_large("nvme", seconds, speeds)
                elif rep:
                    out.add_tiny("nvme", n, seconds)


def measure_service(directory: Path, reps: int, blocks: int, log: Callable[[str], None],
                    baseline: Callable[[], Any]) -> ServiceLoads:
    """Load times of ``blocks`` 16 MiB blocks and of tiny prefixes, per source;
    ``baseline()`` is called right before each repetition's large loads."""
    if blocks in TINY_SIZES:
        raise ValueError(f"blocks must differ from the tiny sizes {TINY_SIZES}")
    out = ServiceLoads()
    _memory(directory, reps, blocks, out, log, baseline)
    _disk(directory, reps, blocks, out, log, baseline)
    return out
