"""Every byte the simulated agents move: loads, stores, demotions, pool writes.

Each movement is an agent ``Job`` whose ``run`` reserves the links of its path (see
``links.reserve``) and whose ``done`` commits the result to the tiers and the directory. Where
a block goes is the placement policy's answer, whether it deserves the slow tiers is the
admission policy's (a node counts sightings for NVMe and, apart, for the pool, as the
service's agent does); a tier that fills evicts in its eviction policy's order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cmx.policies.admission import AdmissionPolicy, make_admission
from cmx.policies.breakeven import source_class
from cmx.simulate.agent import Agent, Job, Priority
from cmx.simulate.cluster import DRAM, HBM, NVME, POOL, TIER_OF, Cluster, Node, Replica
from cmx.simulate.hardware import ModelSpec
from cmx.simulate.links import Resource, reserve
from cmx.tiers import Tier

__all__ = ["Mover", "Traffic"]


@dataclass
class Traffic:
    """Bytes moved, by kind; and what was dropped for want of queue room or space."""

    loaded: dict[str, int] = field(default_factory=dict)  # by source class
    stored: int = 0  # HBM -> this node's DRAM
    demoted: int = 0  # DRAM -> NVMe (write-back) and write-through NVMe writes
    pooled: int = 0  # node -> pool NVMe
    network: int = 0  # bytes that crossed a NIC
    dropped_jobs: int = 0  # background writes refused: their class full past the timeout
    unplaced: int = 0  # blocks a full (pinned) tier could not take


class Mover:
    def __init__(self, cluster: Cluster, model: ModelSpec, unit: int,
                 submit: Callable[[Agent, Job], None]) -> None:
        self.cluster = cluster
        self.strategy = cluster.strategy
        self.spec = cluster.spec
        self.unit_bytes = unit * model.kv_bytes_per_token
        self.io_bytes = self.strategy.io_size(model.kv_bytes_per_token)
        self.submit = submit
        self.traffic = Traffic()
        self._pooling: set[bytes] = set()
        # Per node, which blocks go to the pool: a sketch of its own, as the service's agent
        # keeps one for NVMe and one for the pool, each with its own count.
        self._pool_admission: dict[int, AdmissionPolicy] = {}
        n = self.spec.node
        self._latency = (1e-6, n.dram.latency_s, n.nvme.latency_s, self.spec.pool.latency_s)
        # Each tier's source class seen from the node that holds it, and from another.
        names = [t.value for t in TIER_OF]
        self._classes = ([source_class(t, "here", "here") for t in names],
                         [source_class(t, "there", "here") for t in names])

    # -- where a copy is, seen from a node -----------------------------------------------------

    def source_class(self, code: int, here: Node) -> str:
        return self._classes[code >> 2 != here.index][code & 3]

    def path(self, code: int, replica: Replica) -> tuple[list[Resource], float]:
        """The links a block at ``code`` crosses into ``replica``'s HBM, and their latency."""
        src = self.cluster.all_nodes[code >> 2]
        here = replica.node
        tier = code & 3
        first = src.hbm if tier == HBM else src.dram_bus if tier == DRAM else src.nvme_read
        latency = self._latency[tier]
        if src is here:
            return ([src.hbm] if tier == HBM else [first, replica.h2d]), latency
        return ([first, src.nic_out, here.nic_in, replica.h2d],
                latency + self.spec.network.latency_s)

    def cpu_seconds(self, nbytes: int, verified: bool) -> float:
        """One thread's CPU work in loading ``nbytes``: the orchestrator's and the consumer's."""
        return self.io_cpu_seconds(nbytes) + self.consumer_cpu_seconds(nbytes, verified)

    def consumer_cpu_seconds(self, nbytes: int, verified: bool) -> float:
        """The CPU work on ``nbytes`` loaded, after they moved: on a host without a GPU, the
        copy-out; the checksum of NVMe and network reads (``verified``); the consumer's of
        every block."""
        s = self.strategy
        t = nbytes / s.copy_out_bandwidth if s.copy_out_bandwidth else 0.0
        if s.verify_bandwidth:
            t += nbytes / s.verify_bandwidth * (int(verified) + int(s.consumer_verifies))
        return t

    def io_cpu_seconds(self, nbytes: int) -> float:
        """The orchestrator's work to issue and complete the I/Os of ``nbytes``, one after
        another."""
        return -(-nbytes // self.io_bytes) * self.strategy.per_io_cpu_s

    def link_priors(self) -> dict[str, tuple[float, float]]:
        """Latency and bandwidth of each source class on the simulated hardware: what a
        deployment's break-even models would have measured."""
        spec, s = self.spec, self.strategy
        n, net = spec.node, spec.network
        link = n.replica_link_bandwidth
        out = {}
        hbm = n.gpu.hbm_bandwidth * n.gpus_per_replica
        for cls, (lat, bw, verified) in {
            "hbm": (1e-6, hbm, False),
            "hbm@peer": (net.latency_s, min(link, net.bandwidth), True),
            "dram": (n.dram.latency_s, min(link, n.dram_bus_bandwidth), False),
            "nvme": (n.nvme.latency_s, min(link, n.nvme.bandwidth), True),
            "dram@peer": (n.dram.latency_s + net.latency_s, min(link, net.bandwidth), True),
            "nvme@peer": (n.nvme.latency_s + net.latency_s,
                          min(link, net.bandwidth, n.nvme.bandwidth), True),
            "pool@peer": (spec.pool.latency_s + net.latency_s,
                          min(link, net.bandwidth, spec.pool.bandwidth), True),
        }.items():
            per_byte = 1.0 / bw + self.cpu_seconds(1 << 30, verified) / (1 << 30)
            out[cls] = (s.control_s + lat, 1.0 / per_byte)
        return out

    # -- loads ---------------------------------------------------------------------------------

    def load_job(self, replica: Replica, sources: list[int], keys: list[bytes],
                 priority: Priority) -> Job:
        """Move ``keys`` (their copies at ``sources``) into ``replica``'s HBM; pins them now."""
        for key, code in zip(keys, sources):
            self.cluster.cache(code).pin(key)
        by_code: dict[int, int] = {}
        for code in sources:
            by_code[code] = by_code.get(code, 0) + self.unit_bytes
        s = self.strategy

        def run(now: float) -> float:
            end = now
            if job.cancelled:
                return end
            begin = now + s.control_s
            here = replica.node.index
            for code, nbytes in by_code.items():
                path, latency = self.path(code, replica)
                end = max(end, reserve(path, begin, nbytes, latency, self.io_bytes, s.io_depth,
                                       s.per_io_wait_s))
                if code == here * 4 + HBM:
                    continue  # in this node's HBM (vLLM's own prefix cache): no I/O to make
                verified = code % 4 != DRAM or code // 4 != here
                job.cpu_s += self.io_cpu_seconds(nbytes)
                job.consumer_cpu_s += self.consumer_cpu_seconds(nbytes, verified)
            return end

        def done(now: float) -> None:
            if job.cancelled:
                return  # its pins went when it was cancelled
            self.release(keys, sources, hit=True)
            self.keep_in_hbm(replica.node, keys)
            for code, nbytes in by_code.items():
                cls = self.source_class(code, replica.node)
                self.traffic.loaded[cls] = self.traffic.loaded.get(cls, 0) + nbytes
                if code // 4 != replica.node.index:
                    self.traffic.network += nbytes

        def let_go(now: float) -> None:
            self.release(keys, sources, hit=False)

        job = Job(priority, run, done, cpu=replica.node.cpu, process=self.orchestrator(replica),
                  consumer_process=replica.index,
                  refused=[lambda now: None if job.cancelled else let_go(now)],
                  on_cancel=[let_go])
        return job

    def orchestrator(self, replica: Replica) -> int | None:
        """Whose threads issue ``replica``'s I/Os: its serving process's for an in-process
        library, the agent's (None) otherwise."""
        return replica.index if self.strategy.in_process else None

    def used_in_place(self, replica: Replica, keys: list[bytes], hit: bool) -> None:
        """Blocks in ``replica``'s node's HBM, pinned for its request, are read where they are
        (a hit, unless the request recomputed everything): no move, no CPU."""
        code = replica.node.index * 4 + HBM
        self.release(keys, [code] * len(keys), hit)
        if hit:
            self.traffic.loaded["hbm"] = (self.traffic.loaded.get("hbm", 0)
                                          + len(keys) * self.unit_bytes)

    def release(self, keys: list[bytes], sources: list[int], hit: bool) -> None:
        """Unpin what ``load_job`` pinned; a completed load counts as a hit of each copy."""
        for key, code in zip(keys, sources):
            cache = self.cluster.cache(code)
            cache.unpin(key)
            if hit and key in cache:
                cache.touch(key)

    def keep_in_hbm(self, node: Node, keys: list[bytes]) -> None:
        """Blocks now in this node's HBM stay there, as a cache, until evicted."""
        for key in keys:
            if not self.cluster.has(key, node, HBM):
                self.cluster.add_copy(key, node, HBM, self.unit_bytes)

    # -- stores and what follows from them -----------------------------------------------------

    def store(self, replica: Replica, keys: list[bytes]) -> None:
        """Hand freshly computed blocks to the node's agent: HBM -> DRAM, then placement."""
        if not keys:
            return
        node = replica.node
        nbytes = len(keys) * self.unit_bytes

        def run(now: float) -> float:
            return reserve([replica.d2h, node.dram_bus], now, nbytes, self.spec.node.dram.latency_s,
                           self.io_bytes, self.strategy.io_depth, self.strategy.per_io_wait_s)

        process = self.orchestrator(replica)

        def done(now: float) -> None:
            self.traffic.stored += nbytes
            for key in keys:
                self.commit(node, key, process)

        self.submit(node.agent, Job(Priority.DEMOTE, run, done, cpu=node.cpu,
                                    cpu_s=self.io_cpu_seconds(nbytes), process=process,
                                    refused=[self._refused]))

    def _refused(self, now: float) -> None:
        self.traffic.dropped_jobs += 1

    def commit(self, node: Node, key: bytes, process: int | None = None) -> None:
        """``key`` stored on ``node`` by ``process``'s orchestrator (None: the agent's), which
        also makes the NVMe writes that follow."""
        node.admission.record(key)
        admitted = node.admission.admit(key)
        for tier in self.cluster.placement.on_store(admitted):
            if tier is Tier.DRAM:
                self._put_dram(node, key, process)
            elif tier is Tier.NVME:
                self._write(node, key, NVME, process)
        if self._pool_admits(node, key):
            self.maybe_pool(node, key, process)

    def sighted(self, holder: Node, key: bytes) -> None:
        """A lookup hit ``key`` on ``holder``: count it; a block that just became worth
        pooling is pooled."""
        holder.admission.record(key)
        if self._pool_admits(holder, key) and self.cluster.has(key, holder, DRAM):
            self.maybe_pool(holder, key)

    def _pool_admits(self, node: Node, key: bytes) -> bool:
        """Count a sighting of ``key`` on ``node`` for the pool; whether it is worth pooling."""
        policy = self._pool_admission.get(node.index)
        if policy is None:
            s = self.strategy
            policy = self._pool_admission[node.index] = (
                make_admission("frequency", min_count=s.pool_admission_min_count,
                               capacity=1 << 14)
                if s.admission == "frequency" else make_admission(s.admission))
        policy.record(key)
        return policy.admit(key)

    def _put_dram(self, node: Node, key: bytes, process: int | None) -> None:
        evicted = self.cluster.add_copy(key, node, DRAM, self.unit_bytes)
        if evicted is None:
            self.traffic.unplaced += 1
            return
        for victim in evicted:
            below = self.cluster.placement.on_evict(
                Tier.DRAM, node.admission.admit(victim),
                has_lower_copy=self.cluster.has(victim, node, NVME))
            if below is Tier.NVME:
                self._write(node, victim, NVME, process)

    def _write(self, node: Node, key: bytes, tier: int, process: int | None) -> None:
        """DRAM -> this node's NVMe, in the background, issued by ``process``'s threads."""
        nbytes = self.unit_bytes
        s = self.strategy

        def run(now: float) -> float:
            return reserve([node.dram_bus, node.nvme_write], now, nbytes,
                           self.spec.node.nvme.latency_s, self.io_bytes, s.io_depth,
                           s.per_io_wait_s)

        def done(now: float) -> None:
            self.traffic.demoted += nbytes
            if self.cluster.add_copy(key, node, tier, nbytes) is None:
                self.traffic.unplaced += 1

        self.submit(node.agent, Job(Priority.DEMOTE, run, done, cpu=node.cpu,
                                    cpu_s=self.io_cpu_seconds(nbytes), process=process,
                                    refused=[self._refused]))

    def maybe_pool(self, node: Node, key: bytes, process: int | None = None) -> None:
        """Copy an admitted block to its pool owner, once, issued by ``process``'s threads
        (None: the agent's)."""
        owner = self.cluster.pool_owner(key) if self.strategy.pool else None
        if owner is None or key in self._pooling or self.cluster.has(key, owner, POOL):
            return
        self._pooling.add(key)
        nbytes = self.unit_bytes
        s = self.strategy

        def run(now: float) -> float:
            path = [node.dram_bus, node.nic_out, owner.nic_in, owner.nvme_write]
            return reserve(path, now, nbytes, self.spec.pool.latency_s, self.io_bytes,
                           s.io_depth, s.per_io_wait_s)

        def done(now: float) -> None:
            self._pooling.discard(key)
            self.traffic.pooled += nbytes
            self.traffic.network += nbytes
            if self.cluster.add_copy(key, owner, POOL, nbytes) is None:
                self.traffic.unplaced += 1

        def refused(now: float) -> None:
            self._pooling.discard(key)
            self.traffic.dropped_jobs += 1

        self.submit(node.agent, Job(Priority.DEMOTE, run, done, cpu=node.cpu,
                                    cpu_s=self.io_cpu_seconds(nbytes), process=process,
                                    refused=[refused]))
