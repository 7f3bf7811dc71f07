"""What a run of the simulator is given: the workload, the cluster, the model, the strategy,
and how finely it is simulated. Checked when made: a replica must hold the model's weights
and its longest context's KV."""

from __future__ import annotations

from dataclasses import dataclass

from cmx.simulate.cluster import ClusterSpec
from cmx.simulate.hardware import LLAMA3_8B, ModelSpec
from cmx.simulate.routing import check_routing
from cmx.simulate.strategy import CMX, Strategy
from cmx.simulate.workload import WorkloadSpec

__all__ = ["SimConfig"]


@dataclass(frozen=True)
class SimConfig:
    workload: WorkloadSpec
    cluster: ClusterSpec = ClusterSpec()
    model: ModelSpec = LLAMA3_8B
    strategy: Strategy = CMX
    unit_tokens: int = 4096  # tokens per simulated block (an extent of 256-token blocks)
    samples: int = 200  # points of the occupancy and queue-depth series
    routing: str = "least-loaded"  # ``routing.ROUTINGS``: how a request finds its replica
    # Every shared prefix on every GPU node's NVMe before the first arrival: a cache that
    # earlier traffic filled, as the one a hit rate is measured on.
    warm_nvme: bool = False
    hbm_cache: bool = True  # HBM beyond the replicas' work keeps blocks (vLLM's prefix cache)

    def __post_init__(self) -> None:
        if self.unit_tokens < 1 or self.samples < 2:
            raise ValueError("unit_tokens >= 1 and samples >= 2 needed")
        check_routing(self.routing)
        longest = max(t.context_tokens[1] for t in self.workload.tenants)
        need = self.model.weight_bytes + longest * self.model.kv_bytes_per_token
        have = self.cluster.node.replica_hbm_bytes
        if need > have:
            raise ValueError(
                f"{self.model.name} with a {longest:,}-token context needs {need / 1e9:.0f} GB "
                f"of HBM (weights + KV), a replica of {self.cluster.node.gpus_per_replica} "
                f"GPU(s) has {have / 1e9:.0f} GB: use more GPUs per replica")
