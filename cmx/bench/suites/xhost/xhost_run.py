"""The measuring process of ``transfer-hosts``, run in the driver's own network namespace.

``python -m cmx.bench.suites.xhost.xhost_run --blocks N --reps R --dir DIR`` makes two hosts
(``cmx.bench.harness.hosts``): host a (the head and this driver) and host b, joined by veths over a
bridge, so that between them there is only TCP. A prefix of N Llama-3-8B blocks (32 MiB each)
is stored from host b and held only there. Then, R times and alternated (A B A B):

A. ``NamespaceClient.load`` of the prefix by this client on host a (the lookup, b's agent and
   a's agent moving the blocks over the transport, the copy out with every checksum checked);
   a's copies are evicted before each load, so every load crosses the network;
B. the same number of bytes over one TCP stream from a sender on host b into this process
   (``cmx.bench.suites.xhost.tcp_copy``).

One load and one copy go untimed first (the agents connect on their first transfer). Progress
lines go to stderr, each starting with ``LOG_MARK``; the samples are the last line of stdout,
as JSON (``Samples``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np

from cmx.bench.harness.core import GB
from cmx.doors import Evict

__all__ = ["LOG_MARK", "RunArgs", "Samples", "main", "parse_args"]

LOG_MARK = "xhost: "
NAMESPACE_SEED = 11  # the prefix's token ids and KV; both hosts derive them from it


@dataclass(frozen=True)
class RunArgs:
    blocks: int  # blocks of the prefix held on host b
    reps: int  # timed loads, each followed by one timed TCP copy
    dir: str  # the NVMe root; each host gets a private copy of it


def parse_args(argv: Sequence[str]) -> RunArgs:
    """``--blocks N --reps R --dir DIR``; N and R at least 1 (SystemExit otherwise)."""
    parser = argparse.ArgumentParser(prog="python -m cmx.bench.suites.xhost.xhost_run")
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--dir", required=True)
    ns = parser.parse_args(list(argv))
    if ns.blocks < 1 or ns.reps < 1:
        parser.error(f"--blocks and --reps must be >= 1, got {ns.blocks} and {ns.reps}")
    return RunArgs(ns.blocks, ns.reps, ns.dir)


@dataclass(frozen=True)
class Samples:
    """What one run measured, one entry per repetition, in GB/s."""

    nbytes: int
    load: list[float]  # ContextMemory.load, whole
    tcp: list[float]  # one TCP stream, same bytes, right after each load
    via: str  # the transport a's agent used
    hosts: list[str]  # hostnames of a and b, as each saw its own

    @classmethod
    def from_json(cls, line: str) -> Samples:
        return cls(**json.loads(line))


class _Writer:
    """The service's client on host b: stores the prefix there."""

    def __init__(self, config: Any) -> None:
        from cmx.client import ContextMemory

        self.cm = ContextMemory.connect(config=config, start_service=False)

    def store(self, blocks: int) -> tuple[str, str]:
        from cmx.bench.harness.cluster import LLAMA, store_prefix

        store_prefix(self.cm, LLAMA, blocks, seed=NAMESPACE_SEED)
        return self.cm.node_id, socket.gethostname()


def measure(args: RunArgs, log: Callable[[str], None]) -> Samples:
    import ray

    from cmx.bench.harness.cluster import LLAMA, on_node
    from cmx.bench.harness.hosts import Hosts
    from cmx.bench.suites.xhost.tcp_copy import TcpSource
    from cmx.client import ContextMemory
    from cmx.config import ServiceConfig
    from cmx.stats import transport_of

    block = LLAMA.block_bytes
    nbytes = args.blocks * block
    config = ServiceConfig(block_bytes=block, hbm_bytes=nbytes + 4 * block,
                           dram_bytes=nbytes + 4 * block, nvme_bytes=4 * nbytes,
                           nvme_dir=args.dir, directory_shards=1, call_timeout_s=30.0,
                           load_timeout_s=300.0)
    hosts = Hosts(head_node_args={"num_cpus": 2}, private_dirs=(args.dir,))
    try:
        log("starting host b")
        b_host = hosts.add_node(num_cpus=1, name="b")
        cm = ContextMemory.connect(address=hosts.address, config=config, log_to_driver=False)
        try:
            # ray.remote keeps a class's own type for mypy, which then knows no .options.
            writer = cast(Any, ray.remote(_Writer)).options(
                num_cpus=0, scheduling_strategy=on_node(b_host.node_id)).remote(config)
            log(f"storing {nbytes >> 20} MiB on host b")
            b_node, b_name = ray.get(writer.store.remote(args.blocks), timeout=600)
            prefix = _Prefix(cm, b_node, args.blocks)
            into = np.ones(nbytes, np.uint8).data  # faulted in before any copy is timed
            tcp = TcpSource(["ip", "netns", "exec", b_host.netns], b_host.address)
            try:
                prefix.load_gbps()  # untimed: a's agent connects to b's on its first read
                tcp.copy(into)
                load, copies = [], []
                for rep in range(args.reps):
                    log(f"rep {rep + 1}/{args.reps}")
                    load.append(prefix.load_gbps())
                    copies.append(nbytes / tcp.copy(into) / GB)
            finally:
                tcp.close()
            via = transport_of(cm.stats(), cm.node_id)
            ray.kill(writer)
        finally:
            cm.shutdown(stop_service=True)
            ray.shutdown()
    finally:
        hosts.shutdown()
    return Samples(nbytes, load, copies, via, [socket.gethostname(), b_name])


class _Prefix:
    """The prefix held on host b, loaded by this client on host a."""

    def __init__(self, cm: Any, b_node: str, blocks: int) -> None:
        from cmx.bench.harness.cluster import LLAMA

        self.cm = cm
        self.b_node = b_node
        self.ns = cm.namespace("bench", LLAMA, f"s{NAMESPACE_SEED}")
        T = LLAMA.block_tokens
        # as store_prefix drew them on host b
        self.toks = np.random.default_rng(NAMESPACE_SEED).integers(0, 100_000, blocks * T)
        self.keys = self.ns.keys(self.toks)
        self._wait_only_on_b()

    def _wait_only_on_b(self, timeout_s: float = 120.0) -> None:
        """Until the directory shows every block, and every copy of it on host b: a's copies
        are evicted as they show (a copy still pinned, its load's release in flight, stays
        until the next try)."""
        from cmx.links import actor_name

        here = self.cm.node_id
        deadline = time.monotonic() + timeout_s
        while True:
            match = self.ns.lookup(self.toks)
            nodes = {c.node for b in match.blocks for c in b.copies}
            if match.num_blocks == len(self.keys) and nodes == {self.b_node}:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{match.num_blocks} of {len(self.keys)} blocks found, "
                                     f"held on {sorted(nodes)}, not only on host b")
            by_tier: dict[str, list[Any]] = {}
            for b in match.blocks:
                for c in b.copies:
                    if c.node == here:
                        by_tier.setdefault(c.tier.value, []).append(b.key)
            for tier, keys in by_tier.items():
                self.cm.link.call(actor_name(tier, here), Evict(keys=keys))
            time.sleep(0.2)

    def load_gbps(self) -> float:
        """GB/s of one load by this client, of the prefix held only on host b."""
        self._wait_only_on_b()
        t0 = time.perf_counter()
        got = self.ns.load(self.toks)
        dt = time.perf_counter() - t0
        if got.shape[3] != len(self.toks):
            raise AssertionError(f"loaded {got.shape[3]} of {len(self.toks)} tokens")
        return got.numel() * got.element_size() / dt / GB


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    samples = measure(args, lambda m: print(f"{LOG_MARK}{m}", file=sys.stderr, flush=True))
    print(json.dumps(asdict(samples)), flush=True)


if __name__ == "__main__":
    main()
