"""An in-process plane whose node-a runs its agent on a DPU: the agent reaches its host only
through a host endpoint (its arenas and staging registered with NIXL); node-b's agent is an
ordinary one."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from plane import Plane, make_plane
from scenarios import blocks, small_config

from cmx.actors.agent.core import OffloadAgent
from cmx.actors.dpu.agent import NixlHost, dpu_agent_parts
from cmx.actors.dpu.host import HostEndpoint
from cmx.actors.dpu.staging import host_staging_slots
from cmx.keys import BlockHash
from cmx.links import actor_name

__all__ = ["A", "B", "dpu", "dpu_plane", "stored_on_dpu"]

A, B = f"dpu-{os.getpid()}", f"peer-{os.getpid()}"  # node-a on a DPU; node-b


@contextmanager
def dpu_plane(transport: str, root: Path, **changes: object) -> Iterator[Plane]:
    """node-a's agent on a DPU; between the agents NIXL, or the Ray fallback's path."""
    # Names of this process's own: a tier that starts unlinks every arena of its node's name.
    p = make_plane(small_config(root, transport=transport, **changes), nodes=(A, B))
    p.agents[A].close()
    endpoint = HostEndpoint(f"test-endpoint-{transport}-{uuid.uuid4().hex[:6]}",
                            slot_bytes=p.config.block_bytes,
                            staging_slots=host_staging_slots(p.config.block_bytes))
    agent = OffloadAgent(A, p.config, p.link, dpu_agent_parts(A, p.config, endpoint))
    p.agents[A] = p.link._targets[actor_name("agent", A)] = agent  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        p.close()
        endpoint.close()


def dpu(plane: Plane) -> OffloadAgent:
    """node-a's agent, on its DPU: every host-facing move through its ``NixlHost``."""
    agent = plane.agents[A]
    assert isinstance(agent.host, NixlHost)
    return agent


def stored_on_dpu(plane: Plane, n: int, seed: int) -> tuple[list[BlockHash], np.ndarray]:
    """``n`` blocks stored through the DPU agent: DRAM holds 8, the rest only NVMe."""
    keys, payload = blocks(n, seed=seed)
    assert dpu(plane).store(keys, [None, *keys[:-1]], payload) == n
    return keys, payload
