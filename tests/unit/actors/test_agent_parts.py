"""The agent is one class given its host parts: on its host it maps the arenas and opens the
NVMe files itself (``LocalHost``); on a DPU it is the same agent given ``dpu_agent_parts``, its
tiers' arenas known by name only and every host byte over one NIXL access to the host's
endpoint. node-b's agent is the ordinary one, node-a's the DPU's (``dpu_plane``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dpu_plane import A, B, dpu_plane

from cmx.actors.agent.core import OffloadAgent
from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.shared import NodeTiers
from cmx.actors.dpu.access import HostAccessForbidden
from cmx.actors.dpu.agent import HostTiers, NixlHost
from cmx.tiers import Tier


def test_one_agent_class_given_the_dpus_parts_or_its_hosts(tmp_path: Path) -> None:
    with dpu_plane("ray", tmp_path) as plane:
        on_dpu, on_host = plane.agents[A], plane.agents[B]
        assert type(on_dpu) is type(on_host) is OffloadAgent
        # The host's own agent: its tiers and bytes are the plain parts.
        assert type(on_host.tiers) is NodeTiers and type(on_host.host) is HostBytes
        # The DPU's: both parts over the one NIXL access, which the agent's parts share.
        assert isinstance(on_dpu.tiers, HostTiers) and isinstance(on_dpu.host, NixlHost)
        assert on_dpu.tiers.nixl is on_dpu.host.nixl
        assert on_dpu.host.tiers is on_dpu.tiers
        # A host arena is a name to address over NIXL, never memory mapped here.
        hbm = on_dpu.tiers.current(Tier.HBM)
        with pytest.raises(HostAccessForbidden):
            hbm[1].slot_view(0)
        assert hbm[0].arena in on_dpu.host.endpoint.arenas()  # type: ignore[attr-defined]
