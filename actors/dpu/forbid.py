"""What a process playing a DPU cannot do: map a host arena or open a host file.

A BlueField is a separate computer; an agent that reaches its host over the network
(``dpu.nixl_access.NixlAccess``) runs in a process where ``forbid_host_access`` makes both raise
``HostAccessForbidden``, so a path that would only work on the host's own machine fails
loudly instead of passing in tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cmx.errors import CmxError
from cmx.storage.arena import SharedArena
from cmx.storage.nvme.dataplane import ExtentPlane

__all__ = ["HostAccessForbidden", "NoHostFiles", "forbid_host_access"]


class HostAccessForbidden(CmxError):
    """An agent that reaches its host over the network tried to map host memory or open a
    host file: a DPU, a separate computer, has no such path."""


class NoHostFiles(ExtentPlane):
    """The NVMe plane of an agent that reaches its host over the network: it opens no host
    file (the host endpoint moves extents), so any attempt raises HostAccessForbidden."""

    def _open(self, path: str) -> Iterator[int]:  # type: ignore[override]  # only raises
        return _refuse_open(self, path)


def _refuse_open(self: ExtentPlane, path: str) -> Iterator[int]:
    raise HostAccessForbidden(f"cannot open host file {path}: this process is a DPU's")


def forbid_host_access() -> None:
    """From now on, mapping a shared-memory arena or opening an NVMe segment in this process
    raises HostAccessForbidden: the process plays a DPU, which has neither. For the whole
    process and for good, as a separate computer would be."""

    def refuse_map(cls: Any, name: str, populate: bool = False) -> SharedArena:
        raise HostAccessForbidden(f"cannot map host arena {name}: this process is a DPU's")

    attach: Any = classmethod(refuse_map)
    SharedArena.attach = attach  # type: ignore[method-assign]  # on purpose
    ExtentPlane._open = _refuse_open  # type: ignore[assignment, method-assign]  # on purpose
