"""NIXL's Python API, imported with an environment its bundled UCX can leave cleanly.

The UCX inside the NIXL wheels loads its InfiniBand modules on every host. They link a bundled
libnl-route whose exit-time destructor crashes the process (SIGSEGV after all work is done, so
every command and worker using NIXL would exit 139). On a host with no RDMA device those modules
offer nothing, so they are left unloaded. An operator's own ``UCX_MODULES`` always wins.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

__all__ = ["nixl_api"]

RDMA_DEVICES = Path("/sys/class/infiniband")
WITHOUT_RDMA_MODULES = "^ib,ib_*"


def has_rdma_device(devices: Path = RDMA_DEVICES) -> bool:
    return devices.is_dir() and any(devices.iterdir())


def nixl_api() -> ModuleType:
    """``nixl._api``; must be the first import of NIXL in the process for the setting to hold."""
    if not has_rdma_device():
        os.environ.setdefault("UCX_MODULES", WITHOUT_RDMA_MODULES)
    import nixl._api as api

    return api
