"""The service's own load times, through the public client API, for the calibration.

Two embedded clusters from the benchmarks' harness (``cmx.bench.harness.cluster``; node "a" stores,
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
b for the peer loads); one client loads ``ALONE`` prefixes, one after another. Every load runs
on a client thread, never the caller's: a thread's new tensor gets fresh pages, where the
calling thread's can reuse its heap's and copy several times faster, which would make a
load's speed depend on what ran before it. Every load's wall time is kept, and the
machine's busy CPU-seconds over the loads of each cell, measured on the loads' own side.
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

from cmx.bench.harness.proc_cpu import machine_busy_s
from cmx.config import ServiceConfig
from cmx.layout import KVLayout
from cmx.stats import transport_of

__all__ = ["BLOCK_BYTES", "ServiceLoads", "measure_service"]

LARGE = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                 block_tokens=128)
TINY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
BLOCK_BYTES = LARGE.block_bytes  # 16 MiB: two clusters' arenas must fit a shared machine
TINY_SIZES = (1, 8)
TINY_LOADS = 3  # tiny loads of each size, one after another, per repetition: the median kept
ALONE = 3  # loads of one client, one after another, per repetition
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
    # source -> per repetition, the cores the machine keeps busy with the cluster up and no
    # load running (Ray, the agents' transfer threads polling, the neighbours)
    idle: dict[str, list[float]] = field(default_factory=dict)

    def add_tiny(self, source: str, n: int, seconds: list[float]) -> None:
        """A repetition's tiny loads of ``n`` blocks: their median."""
        self.tiny.setdefault(source, {}).setdefault(n, []).append(float(np.median(seconds)))

    def add_large(self, source: str, clients: int, seconds: list[float], busy_s: float) -> None:
        """One repetition's cell: every load's seconds, and the machine's busy CPU-seconds
        over them."""
        self.large.setdefault(source, {}).setdefault(clients, []).append(list(seconds))
        self.cpu.setdefault(source, {}).setdefault(clients, []).append(busy_s / len(seconds))

    def add_baseline(self, sources: tuple[str, ...], speeds: Any, idle: float) -> None:
        """A repetition's machine speeds, and the machine's busy cores with no load running."""
        for source in sources:
            self.baselines.setdefault(source, []).append(speeds)
            self.idle.setdefault(source, []).append(idle)

    def load_cpu_alone(self, source: str, rep: int) -> float | None:
        """The machine's busy CPU-seconds of one load alone in repetition ``rep``, less what it
        keeps busy without a load over the load's time: the load's own CPU."""
        cpu = self.cpu.get(source, {}).get(1, [])
        if rep >= len(cpu):
            return None
        seconds = float(np.mean(self.large[source][1][rep]))
        idle = self.idle[source][rep] if rep < len(self.idle.get(source, [])) else 0.0
        return max(0.0, cpu[rep] - idle * seconds)


def _idle_busy(seconds: float = 1.0) -> float:
    """Cores the machine keeps busy over ``seconds`` with nothing asked of the service."""
    before = machine_busy_s()[0]
    time.sleep(seconds)
    return (machine_busy_s()[0] - before) / seconds


def _tokens(layout: KVLayout, blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, blocks * layout.block_tokens)


def _store(cm: Any, layout: KVLayout, blocks: int, seed: int) -> tuple[Any, np.ndarray, Any]:
    """Store a prefix of ``blocks`` blocks on the client's node; returns (ns, tokens, the
    checksums of its first and last block) for checking what comes back."""
    ns = cm.namespace("calibration", layout, f"s{seed}")
    toks = _tokens(layout, blocks, seed)
    T = layout.block_tokens
    first = last = None
    for start in range(0, blocks, 4):  # bounded memory: 4 blocks of KV at a time
        n = min(4, blocks - start)
        kv = layout.random_kv(n * T, seed=seed * 1000 + start)
        ns.store(toks[: (start + n) * T], kv, start=start * T).wait()
        first = _block_sum(kv[:, :, :, :T]) if start == 0 else first
        last = _block_sum(kv[:, :, :, -T:])
    return ns, toks, (first, last)


def _block_sum(kv: Any) -> int:
    """The checksum of one block's KV: what a loader compares, in place of the block (a few
    bytes through Ray's object store, where the blocks would be 32 MiB a prefix)."""
    from cmx.checksum import checksum

    return int(checksum(kv.contiguous()))


def _timed_load(ns: Any, toks: np.ndarray, blocks: int, check: Any) -> tuple[float, float]:
    """A load's wall time, and the machine's busy CPU-seconds over it (the check of what came
    back and the tensor's release are outside both)."""
    busy = machine_busy_s()[0]
    t0 = time.perf_counter()
    kv = ns.load(toks)
    seconds = time.perf_counter() - t0
    busy = machine_busy_s()[0] - busy
    T = ns.layout.block_tokens
    if kv.shape[3] != blocks * T:
        raise AssertionError(f"loaded {kv.shape[3] // T} of {blocks} blocks")
    first, last = check
    if (_block_sum(kv[:, :, :, :T]), _block_sum(kv[:, :, :, -T:])) != (first, last):
        raise AssertionError("a loaded block differs from the one stored")
    return seconds, busy


def _wait_tier(ns: Any, toks: np.ndarray, blocks: int, tier: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = ns.lookup(toks)
        if m.num_blocks == blocks and all(b.tier.value == tier for b in m.blocks):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the prefix did not settle in {tier} within {timeout_s} s")


def _timed_loads(loads: list[tuple[Any, np.ndarray, Any]], blocks: int,
                 together: bool = True) -> tuple[list[float], float]:
    """Each of ``loads`` (ns, tokens, check) on a thread of its own, all started at once (or,
    ``together=False``, one after another on one thread): every load's wall time, and the
    machine's busy CPU-seconds over the loads (from the first one's start to the last one's
    end; one after another, the sum over each load)."""
    threads = len(loads) if together else 1
    start = threading.Barrier(threads, timeout=CALL_TIMEOUT_S)

    def one(load: tuple[Any, np.ndarray, Any]) -> tuple[float, float]:
        if together:
            start.wait()
        return _timed_load(load[0], load[1], blocks, load[2])

    with ThreadPoolExecutor(threads) as pool:
        busy = machine_busy_s()[0]
        timed = list(pool.map(one, loads))
        busy = machine_busy_s()[0] - busy
    times = [seconds for seconds, _ in timed]
    return times, busy if together else sum(each for _, each in timed)


def _loader_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Loader:
        """A client on another node: its loads go through that node's agent."""

        def __init__(self, config: ServiceConfig) -> None:
            from cmx.client import ContextMemory

            self.cm = ContextMemory.connect(config=config)

        def load(self, layout: KVLayout, seeds: list[int], blocks: int, checks: list[Any],
                 together: bool) -> tuple[list[float], float]:
            """The prefixes stored under ``seeds``, as ``_timed_loads`` loads them."""
            loads = [(self.cm.namespace("calibration", layout, f"s{seed}"),
                      _tokens(layout, blocks, seed), check) for seed, check in zip(seeds, checks)]
            return _timed_loads(loads, blocks, together)

    return Loader


def _round_trips(node: str, n: int = 100) -> list[float]:
    """Seconds of ``n`` calls to an empty actor method on ``node``: what one hop of the
    control path costs here, to read the tiny loads' costs by."""
    import ray

    from cmx.bench.harness.cluster import on_node

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


def _prefixes(clients: int) -> int:
    """Prefixes a cell of ``clients`` loads: its own each, or ``ALONE`` for one client."""
    return ALONE if clients == 1 else clients


def _most(blocks: int, clients: tuple[int, ...]) -> int:
    """Slots the widest cell stores, with room to spare."""
    widest = max(max(_prefixes(c) for c in clients) * blocks, TINY_LOADS * max(TINY_SIZES))
    return widest + sum(TINY_SIZES)


def _cells(blocks: int, clients: tuple[int, ...]) -> list[tuple[KVLayout, int, int]]:
    """One repetition's cells, (layout, blocks per prefix, clients): the tiny loads alone,
    then each number of clients."""
    return [(TINY, n, 1) for n in TINY_SIZES] + [(LARGE, blocks, c) for c in clients]


def _stored(bc: Any, layout: KVLayout, blocks: int, clients: int,
            seed: int) -> list[tuple[Any, np.ndarray, Any]]:
    """A cell's prefixes, each stored under a seed from ``seed + 1`` on."""
    count = _prefixes(clients) if layout is LARGE else TINY_LOADS
    return [_store(bc.cm, layout, blocks, seed + 1 + i) for i in range(count)]


def _memory(directory: Path, reps: int, blocks: int, clients: tuple[int, ...],
            sources: tuple[str, ...], out: ServiceLoads, log: Callable[[str], None],
            baseline: Callable[[], Any]) -> None:
    import ray

    from cmx.bench.harness.cluster import bench_cluster, on_node

    peer, local = "dram@peer" in sources, "dram" in sources
    # DRAM holds every prefix of a cell (each cell's are dropped after its loads): nothing is
    # evicted by a store, so no disk traffic here.
    widest, most = max(_prefixes(c) for c in clients), _most(blocks, clients)
    config = ServiceConfig(block_bytes=BLOCK_BYTES, hbm_bytes=(most + 2) * BLOCK_BYTES,
                           dram_bytes=(most + 4) * BLOCK_BYTES,
                           nvme_bytes=4 * BLOCK_BYTES, nvme_dir=str(directory),
                           load_timeout_s=300, call_timeout_s=CALL_TIMEOUT_S)
    with bench_cluster(config) as bc:
        loader = _loader_class().options(scheduling_strategy=on_node(bc.node_b)).remote(
            bc.config)
        seed = 100
        # Untimed: NIXL connects, code warms, and so do the threads of the most clients and
        # every slot of the arenas a cell uses (each process maps a page at its first touch).
        for layout, n in ((TINY, 1), (LARGE, blocks)):
            warm = [_store(bc.cm, layout, n, seed + i) for i in range(widest)]
            ray.get(loader.load.remote(layout, list(range(seed, seed + len(warm))), n,
                                       [check for _, _, check in warm], True))
            _timed_loads(warm, n)
            for ns, _, _ in warm:
                bc.cm.drop_namespace(ns.namespace)
            seed += len(warm)
        out.round_trip_s = _round_trips(bc.node_a)
        for rep in range(reps):
            log(f"calibration: memory, repetition {rep + 1}/{reps}")
            out.add_baseline(tuple(s for s in ("dram", "dram@peer") if s in sources), baseline(),
                             _idle_busy())
            for layout, n, c in _cells(blocks, clients):
                stored = _stored(bc, layout, n, c, seed)
                seeds = list(range(seed + 1, seed + 1 + len(stored)))
                seed += len(stored)
                checks = [check for _, _, check in stored]
                together = c > 1
                far = ray.get(loader.load.remote(layout, seeds, n, checks, together)) \
                    if peer else None
                near = _timed_loads(stored, n, together) if local else None
                for source, timed in (("dram@peer", far), ("dram", near)):
                    if timed is not None and layout is LARGE:
                        out.add_large(source, c, *timed)
                    elif timed is not None:
                        out.add_tiny(source, n, timed[0])
                for ns, _, _ in stored:  # bounded memory: the arenas hold one cell
                    bc.cm.drop_namespace(ns.namespace)
        via = transport_of(bc.cm.stats(), bc.node_b)
        out.notes.append(f"peer loads through node b's agent, transport {via}")


def _disk(directory: Path, reps: int, blocks: int, clients: tuple[int, ...],
          out: ServiceLoads, log: Callable[[str], None], baseline: Callable[[], Any]) -> None:
    from cmx.bench.harness.cluster import bench_cluster

    per_rep = TINY_LOADS * sum(TINY_SIZES) + sum(_prefixes(c) for c in clients) * blocks + 4
    most = _most(blocks, clients)
    config = ServiceConfig(block_bytes=BLOCK_BYTES, hbm_bytes=(most + 2) * BLOCK_BYTES,
                           dram_bytes=4 * BLOCK_BYTES, placement="write_back",
                           nvme_bytes=(reps + 1) * per_rep * BLOCK_BYTES + 64 * BLOCK_BYTES,
                           nvme_dir=str(directory), load_timeout_s=300,
                           call_timeout_s=CALL_TIMEOUT_S)
    with bench_cluster(config) as bc:
        seed = 500
        # The first repetition is a warm-up, untimed, of the most clients: every slot of the
        # HBM arena a cell uses is touched once.
        for rep in range(reps + 1):
            log(f"calibration: disk, repetition {rep}/{reps}" + (" (warm-up)" if not rep else ""))
            cells = _cells(blocks, clients if rep else (max(clients),))
            stored = []
            for layout, n, c in cells:
                prefixes = _stored(bc, layout, n, c, seed)
                stored.append((layout, n, c, prefixes))
                seed += len(prefixes)
            seed += 1
            _store(bc.cm, TINY, 4, seed)  # four more: the DRAM's four slots turn over
            for _, n, _, prefixes in stored:
                for ns, toks, _ in prefixes:
                    _wait_tier(ns, toks, n, "nvme")
            if rep:
                out.add_baseline(("nvme",), baseline(), _idle_busy())
            for layout, n, c, prefixes in stored:
                timed = _timed_loads(prefixes, n, together=c > 1)
                if rep and layout is LARGE:
                    out.add_large("nvme", c, *timed)
                elif rep:
                    out.add_tiny("nvme", n, timed[0])
                for ns, _, _ in prefixes:  # the loads' copies leave HBM: the next cell's
                    bc.cm.drop_namespace(ns.namespace)  # loads find room, nothing demoted


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
