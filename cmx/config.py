"""Service configuration: frozen, typed, layered. Every environment variable is read here.

Precedence: defaults < environment (``CMX_*``) < explicit arguments (``ServiceConfig(...)`` or
``config.replace(...)``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AdminConfig", "ServiceConfig", "model_cache_dir"]

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class ServiceConfig:
    block_bytes: int = 2 * MiB  # slot size of the arenas: the largest block any namespace stores
    hbm_bytes: int = 256 * MiB  # per node; emulated on host memory (on GPU nodes too, for now)
    dram_bytes: int = 1 * GiB  # per node, shared-memory arena
    nvme_bytes: int = 8 * GiB  # per node, segment files under nvme_dir
    nvme_dir: str = "/var/tmp/cmx"  # per-node subdirectories are made under it
    node_id_label: str = "cmx.io/node-id"  # node label naming a node's store; else one claimed
    orphan_max_age_s: float = 7 * 86400.0  # store dirs unclaimed this long are removed; 0: never
    nvme_segment_bytes: int = 256 * MiB  # size of one log segment file
    directory_shards: int = 2  # directory actors; keys spread by hash
    # label of the nodes the directory shards are pinned to (round robin; one lost with its
    # node the controller starts again: actors/directory/placement.py); none: Ray places them
    directory_label: str = "cmx.io/directory"
    eviction: str = "lru"  # eviction policy of every tier ("lru", "s3fifo")
    placement: str = "write_back"  # "write_back" (NVMe on DRAM eviction) or "write_through"
    nvme_admission_min_count: int = 1  # times a block must be seen before it goes to NVMe
    pool_label: str = "cmx.io/pool"  # label of pool (G4) storage nodes; its value names the disk
    pool_bytes: int = 16 * GiB  # per pool node, segment files under nvme_dir/pool-<label value>
    pool_replication: int = 2  # owners of a pooled block (fewer if fewer pool nodes)
    pool_admission_min_count: int = 2  # times a block is seen (stored or loaded) before pooling
    pool_staging_bytes: int = 64 * MiB  # a pool node's DRAM for staging and caching blocks
    transport: str = "auto"  # "auto" (NIXL where it loads), "nixl" or "ray"
    dpu_label: str = "cmx.io/dpu"  # node label of DPU nodes; their agent serves a host node
    host_label: str = "cmx.io/host-id"  # names the host a node (or a DPU) belongs to
    # How an agent on a DPU reaches its host: "shared" maps the host's shared memory and opens
    # its files (a DPU node on the host's machine); "nixl" moves every byte through NIXL, as a
    # BlueField, a separate computer, must (actors/dpu/agent.py)
    dpu_access: str = "shared"
    agent_workers: int = 4  # agent threads moving bytes
    agent_queue_bound: int = 256  # waiting moves per priority class before backpressure
    staging_bytes: int = 256 * MiB  # agent's temporary-buffer budget
    call_timeout_s: float = 10.0  # bound on every control-plane call
    load_timeout_s: float = 60.0  # bound on one client load, end to end
    heartbeat_s: float = 1.0  # tiers resync the directory at least this often
    lease_s: float = 90.0  # a pin or reservation not ended by its holder is taken back then

    def replace(self, **changes: Any) -> ServiceConfig:
        return dataclasses.replace(self, **changes)

    @property
    def resync_s(self) -> float:
        """How long a source a directory shard asked to resync may take to: the call, or
        the next heartbeat that asks again."""
        return self.heartbeat_s + self.call_timeout_s

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> ServiceConfig:
        """Defaults, then ``CMX_<FIELD>`` variables (e.g. CMX_DRAM_BYTES), then ``overrides``."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
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
        return cls(**values)

    def __post_init__(self) -> None:
        for name in ("block_bytes", "hbm_bytes", "dram_bytes", "nvme_bytes", "directory_shards",
                     "pool_bytes", "pool_replication", "pool_staging_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.lease_s <= 0:
            raise ValueError("lease_s must be positive")
        if self.placement not in ("write_back", "write_through"):
            raise ValueError(f"placement {self.placement!r} is not write_back or write_through")
        if self.transport not in ("auto", "nixl", "ray"):
            raise ValueError(f"transport {self.transport!r} is not auto, nixl or ray")
        if self.dpu_access not in ("shared", "nixl"):
            raise ValueError(f"dpu_access {self.dpu_access!r} is not shared or nixl")


@dataclass(frozen=True)
class AdminConfig:
    """The admin API and the ``cmx`` command line's service state.

    Read from ``CMX_ADMIN_<FIELD>`` (e.g. CMX_ADMIN_TOKEN, CMX_ADMIN_TOKEN_ALL=1) and
    ``CMX_STATE_DIR``. Without a token, mutating endpoints and the queries that reveal what is
    cached (a block's copies, a prefix lookup) are refused; those queries open with
    ``open_queries``; the other reads stay open unless ``token_all`` is set.
    """

    host: str = "127.0.0.1"  # the API binds loopback unless told otherwise
    port: int = 8470  # 0: any free port
    token: str | None = field(default=None, repr=False)  # bearer token; None: no mutations
    token_all: bool = False  # every endpoint (reads too) needs the token
    open_queries: bool = False  # block and prefix-lookup queries answer without the token
    sample_s: float = 2.0  # seconds between stats samples (bandwidth, history, ray metrics)
    history_s: float = 900.0  # how far back the dashboard's history reaches
    state_dir: str = ""  # where `cmx up` records its state; "" means ~/.cache/cmx

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> AdminConfig:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            var = "CMX_STATE_DIR" if f.name == "state_dir" else f"CMX_ADMIN_{f.name.upper()}"
            raw = env.get(var)
            if raw is None:
                continue
            try:
                values[f.name] = _parse(str(f.type), raw)
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> AdminConfig:
        return dataclasses.replace(self, **changes)

    @property
    def state_path(self) -> str:
        root = self.state_dir or os.path.join(os.path.expanduser("~"), ".cache", "cmx")
        return os.path.join(root, "state.json")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is not in 0..65535")
        if self.sample_s <= 0 or self.history_s < self.sample_s:
            raise ValueError("sample_s must be positive and history_s at least sample_s")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("an admin token must be at least 16 characters")


def _parse(kind: str, raw: str) -> object:
    if kind.startswith("bool"):
        if raw.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if raw.strip().lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError("not a boolean (1/0, true/false)")
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    return raw or None if "None" in kind else raw


def model_cache_dir(environ: dict[str, str] | None = None) -> str:
    """Where converted models live: ``CMX_MODEL_CACHE``, default ``~/.cache/cmx/models``."""
    env = os.environ if environ is None else environ
    return env.get("CMX_MODEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cmx",
                                                      "models")
