"""What a simulated cluster is made of: models, GPUs, tiers, nodes, the network.

Defaults are the figures of the hardware this service targets: an H100 SXM5 (80 GB of HBM at
3.35 TB/s), host DRAM reached over PCIe 5.0 x16 (~63 GB/s, 10-100 us), NVMe over PCIe 4.0
(~7 GB/s, 100 us - 1 ms) and a 400 Gb/s NIC per node. Every figure is a field, so a run can
describe another machine (``cmx simulate --calibrate`` describes this one).

A model's KV bytes per token come from ``KVLayout``, the service's own geometry, so the
simulator and the service can never disagree on a block's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cmx.layout import KVLayout
from cmx.policies.breakeven import PrefillCost

__all__ = [
    "GB",
    "GiB",
    "H100",
    "LLAMA3_8B",
    "LLAMA3_70B",
    "MODELS",
    "GpuSpec",
    "ModelSpec",
    "NetworkSpec",
    "NodeSpec",
    "TierSpec",
    "prefill_cost",
]

GB = 1e9  # bandwidths in decimal GB/s
GiB = 1 << 30  # capacities in binary units


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: what it costs to compute a token and to keep its KV."""

    name: str
    params: float  # weights, for the linear layers' 2 FLOPs per weight per token
    num_layers: int
    num_q_heads: int  # attention heads of the queries
    num_kv_heads: int  # KV heads after GQA grouping: what the cache keeps
    head_dim: int
    dtype: str = "bfloat16"

    def layout(self, block_tokens: int = 256) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype,
                        block_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layout(1).token_bytes

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.layout(1).itemsize)

    @property
    def flops_per_token(self) -> float:
        """The linear layers: two FLOPs per weight."""
        return 2.0 * self.params

    @property
    def flops_per_pair(self) -> float:
        """Attention per (query, key) pair: QK^T and PV, 2 FLOPs per element each, per layer."""
        return 4.0 * self.num_layers * self.num_q_heads * self.head_dim


LLAMA3_8B = ModelSpec("llama-3-8b", 8.03e9, num_layers=32, num_q_heads=32, num_kv_heads=8,
                      head_dim=128)
LLAMA3_70B = ModelSpec("llama-3-70b", 70.6e9, num_layers=80, num_q_heads=64, num_kv_heads=8,
                       head_dim=128)
MODELS: dict[str, ModelSpec] = {m.name: m for m in (LLAMA3_8B, LLAMA3_70B)}


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    flops: float  # dense bf16 FLOP/s
    mfu: float = 0.5  # fraction of ``flops`` a prefill reaches (FlashAttention, chunked)
    # fixed cost of one forward pass: launches, scheduling; one host thread's work per pass
    pass_s: float = 2e-3

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")


H100 = GpuSpec("H100-SXM5-80GB", hbm_bytes=80 * 10**9, hbm_bandwidth=3.35e12, flops=989e12)


@dataclass(frozen=True)
class TierSpec:
    """One memory tier of one node: how much it holds and how fast it moves bytes."""

    capacity_bytes: int
    bandwidth: float  # bytes/s into (or out of) the GPUs of one replica's link
    latency_s: float  # per I/O, before its first byte

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0 or self.bandwidth <= 0 or self.latency_s < 0:
            raise ValueError(f"tier needs capacity >= 0, bandwidth > 0, latency >= 0: {self}")


@dataclass(frozen=True)
class NetworkSpec:
    bandwidth: float = 400e9 / 8  # bytes/s per node and direction: a 400 Gb/s NIC
    latency_s: float = 10e-6  # one hop, RDMA

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency_s < 0:
            raise ValueError(f"network needs bandwidth > 0 and latency >= 0: {self}")


@dataclass(frozen=True)
class NodeSpec:
    """A GPU node: its GPUs, how they group into replicas, and its DRAM and NVMe tiers.

    ``dram.bandwidth`` is one GPU's PCIe link; a replica of ``gpus_per_replica`` GPUs loads
    over that many links at once, up to ``dram_bus_bandwidth`` for the whole node.
    """

    gpu: GpuSpec = H100
    gpus: int = 8
    gpus_per_replica: int = 1  # tensor-parallel degree: one replica per this many GPUs
    dram: TierSpec = field(default_factory=lambda: TierSpec(1024 * GiB, 63e9, 50e-6))
    nvme: TierSpec = field(default_factory=lambda: TierSpec(8 * 10**12, 7e9, 300e-6))
    dram_bus_bandwidth: float = 300e9  # the host's memory bandwidth, shared by every link
    nvme_write_bandwidth: float = 3.5e9  # NVMe writes are slower than reads
    # The host's cores, shared by the engines' host work and every move's CPU work: a DGX
    # H100's two 56-core CPUs
    host_cores: int = 112
    # Threads of one serving process (an engine, one per replica) that do CPU work at once:
    # one Python interpreter, whose threads take turns on its lock. Its scheduler, its
    # forward passes' host work and whatever an offload library in it does share them.
    process_threads: int = 1

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_replica < 1 or self.gpus % self.gpus_per_replica:
            raise ValueError(f"{self.gpus} GPUs do not split into replicas of "
                             f"{self.gpus_per_replica}")
        if self.host_cores < 1 or self.process_threads < 1:
            raise ValueError(f"host_cores and process_threads must be >= 1, got "
                             f"{self.host_cores} and {self.process_threads}")

    @property
    def replicas(self) -> int:
        return self.gpus // self.gpus_per_replica

    @property
    def replica_hbm_bytes(self) -> int:
        return self.gpu.hbm_bytes * self.gpus_per_replica

    @property
    def replica_link_bandwidth(self) -> float:
        """Host -> HBM bytes/s of one replica: its GPUs' links, capped by the host's memory."""
        return min(self.dram.bandwidth * self.gpus_per_replica, self.dram_bus_bandwidth)

    def with_replicas_of(self, gpus_per_replica: int) -> NodeSpec:
        return replace(self, gpus_per_replica=gpus_per_replica)


def prefill_cost(model: ModelSpec, node: NodeSpec, chunk: int = 8192) -> PrefillCost:
    """The break-even policy's own prefill model, with coefficients from FLOPs instead of fits.

    A replica of ``gpus_per_replica`` GPUs computes at their summed rate times ``mfu``.
    """
    rate = node.gpu.flops * node.gpu.mfu * node.gpus_per_replica
    return PrefillCost(per_token_s=model.flops_per_token / rate,
                       per_pair_s=model.flops_per_pair / rate,
                       per_pass_s=node.gpu.pass_s, chunk=chunk)
