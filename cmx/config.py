"""Service configuration: frozen, typed, layered. Every environment variable is read here.

Precedence: defaults < environment (``CMX_*``) < explicit arguments (``ServiceConfig(...)`` or
``config.replace(...)``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

__all__ = ["ServiceConfig"]

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ServiceConfig:
    block_bytes: int = 2 * MiB  # slot size of the arenas: the largest block any namespace stores
    hbm_bytes: int = 256 * MiB  # per node; emulated on host memory without a GPU
    dram_bytes: int = 1 * GiB  # per node, shared-memory arena
    nvme_bytes: int = 8 * GiB  # per node, segment files under nvme_dir
    nvme_dir: str = "/var/tmp/cmx"  # per-node subdirectories are made under it
    nvme_segment_bytes: int = 256 * MiB  # size of one log segment file
    directory_shards: int = 2  # directory actors; keys spread by hash
    eviction: str = "lru"  # eviction policy of every tier ("lru", "s3fifo")
    placement: str = "write_back"  # "write_back" (NVMe on DRAM eviction) or "write_through"
    nvme_admission_min_count: int = 1  # times a block must be seen before it goes to NVMe
    transport: str = "auto"  # "auto" (NIXL where it loads), "nixl" or "ray"
    dpu_label: str = "cmx.io/dpu"  # node label of DPU nodes; their agent serves a host node
    host_label: str = "cmx.io/host-id"  # names the host a node (or a DPU) belongs to
    agent_workers: int = 4  # agent threads moving bytes
    agent_queue_bound: int = 256  # waiting moves per priority class before backpressure
    staging_bytes: int = 256 * MiB  # agent's temporary-buffer budget
    call_timeout_s: float = 10.0  # bound on every control-plane call
    load_timeout_s: float = 60.0  # bound on one client load, end to end
    heartbeat_s: float = 1.0  # tiers resync the directory at least this often

    def replace(self, **changes: object) -> ServiceConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> ServiceConfig:
        """Defaults, then ``CMX_<FIELD>`` variables (e.g. CMX_DRAM_BYTES), then ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f"CMX_{f.name.upper()}")
            if raw is None:
                continue
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            try:
                if kind.startswith("int"):
                    values[f.name] = int(raw)
                elif kind.startswith("float"):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw or None
            except ValueError as exc:
                raise ValueError(f"CMX_{f.name.upper()}={raw!r}: {exc}") from None
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        for name in ("block_bytes", "hbm_bytes", "dram_bytes", "nvme_bytes", "directory_shards"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.placement not in ("write_back", "write_through"):
            raise ValueError(f"placement {self.placement!r} is not write_back or write_through")
        if self.transport not in ("auto", "nixl", "ray"):
            raise ValueError(f"transport {self.transport!r} is not auto, nixl or ray")
