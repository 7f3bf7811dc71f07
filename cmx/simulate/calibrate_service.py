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
(4 KiB each, in 16 MiB slots) are loaded alone: their time is the control path. The large
prefixes are loaded by 1, 4, 16 (``clients``) client threads at once, each its own prefix,
started together at a barrier (threads of the driver on node a; threads of one actor on node
b for the peer loads); every load's wall time is kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cmx.bench.proc_cpu import machine_busy_s
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
    # source -> clients -> per repetition, every load's seconds
    large: dict[str, dict[int, list[list[float]]]] = field(default_factory=dict)
    baselines: dict[str, list[Any]] = field(default_factory=dict)  # source -> speeds, per rep
    notes: list[str] = field(default_factory=list)
    round_trip_s: list[float] = field(default_factory=list)  # bare Ray actor calls, node a
    # source -> clients -> per repetition, the machine's busy CPU-seconds per load while the
    # loads ran (every process: the clients, the agents, Ray)
    cpu: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def add_tiny(self, source: str, n: int, seconds: float) -> None:
        self.tiny.setdefault(source, {}).setdefault(n, []).append(seconds)

    def add_large(self, source: str, seconds: list[float]) -> None:
        self.large.setdefault(source, {}).setdefault(len(seconds), []).append(list(seconds))

    def add_cpu(self, source: str, clients: int, busy_s: float) -> None:
        self.cpu.setdefault(source, {}).setdefault(clients, []).append(busy_s / clients)

    def add_baseline(self, sources: tuple[str, ...], speeds: Any) -> None:
        for source in sources:
            self.baselines.setdefault(source, []).append(speeds)


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


def _timed_loads(loads: list[tuple[Any, np.ndarray, Any]], blocks: int) -> list[float]:
    """Each of ``loads`` (ns, tokens, check) on a thread of its own, all started at once:
    every load's wall time."""
    if len(loads) == 1:
        ns, toks, check = loads[0]
        return [_timed_load(ns, toks, blocks, check)]
    start = threading.Barrier(len(loads))

    def one(load: tuple[Any, np.ndarray, Any]) -> float:
        start.wait()
        return _timed_load(load[0], load[1], blocks, load[2])

    with ThreadPoolExecutor(len(loads)) as pool:
        return list(pool.map(one, loads))


def _loader_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Loader:
        """A client on another node: its loads go through that node's agent."""

        def __init__(self, config: ServiceConfig) -> None:
            from cmx.client import ContextMemory

            self.cm = ContextMemory.connect(config=config)

        def load(self, layout: KVLayout, seeds: list[int], blocks: int,
                 checks: list[Any]) -> list[float]:
            """The prefixes stored under ``seeds``, one client thread each, all at once."""
            loads = [(self.cm.namespace("calibration", layout, f"s{seed}"),
                      _tokens(layout, blocks, seed), check) for seed, check in zip(seeds, checks)]
            return _timed_loads(loads, blocks)

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


def _slots(clients: tuple[int, ...], blocks: int) -> int:
    """Slots one repetition stores: the tiny prefixes and each cell's prefixes."""
    return sum(TINY_SIZES) + sum(clients) * blocks


def _memory(directory: Path, reps: int, blocks: int, clients: tuple[int, ...],
            sources: tuple[str, ...], out: ServiceLoads, log: Callable[[str], None],
            baseline: Callable[[], Any]) -> None:
    import ray

    from cmx.bench.cluster import bench_cluster, on_node

    peer, local = "dram@peer" in sources, "dram" in sources
    # DRAM holds every prefix of a cell (each cell's are dropped after its loads): nothing is
    # evicted by a store, so no disk traffic here.
    config = ServiceConfig(block_bytes=BLOCK_BYTES,
                           hbm_bytes=(max(clients) * blocks + sum(TINY_SIZES) + 2) * BLOCK_BYTES,
                           dram_bytes=(max(clients) * blocks + sum(TINY_SIZES) + 4) * BLOCK_BYTES,
                           nvme_bytes=4 * BLOCK_BYTES, nvme_dir=str(directory),
                           load_timeout_s=300, call_timeout_s=CALL_TIMEOUT_S)
    with bench_cluster(config) as bc:
        loader = _loader_class().options(scheduling_strategy=on_node(bc.node_b)).remote(
            bc.config)
        seed = 100
        # Untimed: NIXL connects, code warms, and so do the threads of the most clients.
        warm = [_store(bc.cm, TINY, 1, seed + i) for i in range(max(clients))]
        ray.get(loader.load.remote(TINY, list(range(seed, seed + len(warm))), 1,
                                   [check for _, _, check in warm]))
        _timed_loads(warm, 1)
        for ns, _, _ in warm:
            bc.cm.drop_namespace(ns.namespace)
        seed += len(warm)
        out.round_trip_s = _round_trips(bc.node_a)
        for rep in range(reps):
            log(f"calibration: memory, repetition {rep + 1}/{reps}")
            out.add_baseline(tuple(s for s in ("dram", "dram@peer") if s in sources), baseline())
            cells = [(TINY, n, 1) for n in TINY_SIZES] + [(LARGE, blocks, c) for c in clients]
            for layout, n, c in cells:
                stored = [_store(bc.cm, layout, n, seed + 1 + i) for i in range(c)]
                seeds = list(range(seed + 1, seed + 1 + c))
                seed += c
                checks = [check for _, _, check in stored]
                busy = machine_busy_s()[0]
                far = ray.get(loader.load.remote(layout, seeds, n, checks)) if peer else []
                busy_far, busy = machine_busy_s()[0] - busy, machine_busy_s()[0]
                near = _timed_loads(stored, n) if local else []
                busy_near = machine_busy_s()[0] - busy
                for source, times, cpu in (("dram@peer", far, busy_far),
                                           ("dram", near, busy_near)):
                    if times and layout is LARGE:
                        out.add_large(source, times)
                        out.add_cpu(source, c, cpu)
                    elif times:
                        out.add_tiny(source, n, times[0])
                for ns, _, _ in stored:  # bounded memory: the arenas hold one cell
                    bc.cm.drop_namespace(ns.namespace)
        via = transport_of(bc.cm.stats(), bc.node_b)
        out.notes.append(f"peer loads through node b's agent, transport {via}")


def _disk(directory: Path, reps: int, blocks: int, clients: tuple[int, ...],
          out: ServiceLoads, log: Callable[[str], None], baseline: Callable[[], Any]) -> None:
    from cmx.bench.cluster import bench_cluster

    per_rep = _slots(clients, blocks) + 4
    config = ServiceConfig(block_bytes=BLOCK_BYTES,
                           hbm_bytes=(max(clients) * blocks + sum(TINY_SIZES) + 2) * BLOCK_BYTES,
                           dram_bytes=4 * BLOCK_BYTES, placement="write_back",
                           nvme_bytes=(reps + 1) * per_rep * BLOCK_BYTES + 64 * BLOCK_BYTES,
                           nvme_dir=str(directory), load_timeout_s=300,
                           call_timeout_s=CALL_TIMEOUT_S)
    with bench_cluster(config) as bc:
        seed = 500
        for rep in range(reps + 1):  # the first is a warm-up, of one client
            log(f"calibration: disk, repetition {rep}/{reps}" + (" (warm-up)" if not rep else ""))
            cells = [(TINY, n, 1) for n in TINY_SIZES]
            cells += [(LARGE, blocks, c) for c in (clients if rep else clients[:1])]
            stored = []
            for layout, n, c in cells:
                stored.append((layout, n, [_store(bc.cm, layout, n, seed + 1 + i)
                                           for i in range(c)]))
                seed += c
            seed += 1
            _store(bc.cm, TINY, 4, seed)  # four more: the DRAM's four slots turn over
            for _, n, prefixes in stored:
                for ns, toks, _ in prefixes:
                    _wait_tier(ns, toks, n, "nvme")
            if rep:
                out.add_baseline(("nvme",), baseline())
            for layout, n, prefixes in stored:
                busy = machine_busy_s()[0]
                times = _timed_loads(prefixes, n)
                if rep and layout is LARGE:
                    out.add_large("nvme", times)
                    out.add_cpu("nvme", len(prefixes), machine_busy_s()[0] - busy)
                elif rep:
                    out.add_tiny("nvme", n, times[0])


def measure_service(directory: Path, reps: int, blocks: int, clients: tuple[int, ...],
                    sources: tuple[str, ...], log: Callable[[str], None],
                    baseline: Callable[[], Any]) -> ServiceLoads:
    """Load times of ``blocks`` 16 MiB blocks per load, by ``clients`` clients at once, and
    of tiny prefixes, per source; ``baseline()`` is called at the start of each repetition."""
    if blocks in TINY_SIZES:
        raise ValueError(f"blocks must differ from the tiny sizes {TINY_SIZES}")
    out = ServiceLoads()
    if {"dram", "dram@peer"} & set(sources):
        _memory(directory, reps, blocks, clients, sources, out, log, baseline)
    if "nvme" in sources:
        _disk(directory, reps, blocks, clients, out, log, baseline)
    return out
