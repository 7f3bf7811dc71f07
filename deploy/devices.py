"""What a replica's node gives its engine: the CUDA devices torch sees in the replica's process,
and the GPUs Ray assigned the replica (``ServeOptions.replica_gpus``).

A replica reads its node once (``NodeDevices.here``) and hands the description to
``cmx.deploy.vllm_engine.engine_settings``, the one place that turns it into the engine's
settings; tests hand it descriptions of nodes they do not run on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cmx.errors import CmxError

__all__ = ["Accelerator", "DeviceMismatch", "NodeDevices"]


class Accelerator(enum.Enum):
    """Where a replica's engine runs its model."""

    CPU = "cpu"  # vLLM's CPU build (the image of Dockerfile, the engines extra)
    CUDA = "cuda"  # vLLM's CUDA build (the image of Dockerfile.gpu, the engines-cuda extra)


class DeviceMismatch(CmxError):
    """Ray assigned the replica a GPU that torch does not see: the CPU image on a GPU host, or
    the device hidden from the process. The engine would run on the CPU beside an idle GPU."""


@dataclass(frozen=True)
class NodeDevices:
    """The devices a replica's process may use."""

    cuda_devices: int  # CUDA devices torch sees (0: torch built without CUDA, or none visible)
    ray_gpus: int = 0  # GPUs Ray assigned the replica (its ray_actor_options num_gpus)

    def __post_init__(self) -> None:
        if self.cuda_devices < 0 or self.ray_gpus < 0:
            raise ValueError(f"device counts cannot be negative: {self}")

    @classmethod
    def here(cls) -> NodeDevices:
        """This process's devices. ``torch.cuda.device_count`` asks NVML where it can, so the
        replica does not initialize CUDA before vLLM starts its engine's process."""
        import ray
        import torch

        ray_gpus = 0
        if ray.is_initialized():
            ray_gpus = len(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))
        return cls(cuda_devices=torch.cuda.device_count(), ray_gpus=ray_gpus)
