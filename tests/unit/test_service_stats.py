"""``ContextMemory.stats()`` of a stopped service: every part, the controller that lists the
nodes included, is ``Unreachable`` in its place, never an error; the admin API, which has no
node to show, answers that as a 503 (``UnavailableError``)."""

from __future__ import annotations

import pytest

from cmx.api.backend import ServiceBackend
from cmx.client import ContextMemory
from cmx.config import ServiceConfig
from cmx.errors import UnavailableError
from cmx.links import LocalLink
from cmx.stats import ServiceStats, Unreachable


class StoppedService(LocalLink):
    """The link to a service that was stopped: no actor answers, each call failing as the
    Ray link's does (``UnavailableError``: not running)."""

    def __init__(self) -> None:
        super().__init__({})


def stopped_client(shards: int) -> ContextMemory:
    cm = ContextMemory(ServiceConfig(directory_shards=shards), node_id="n1", owns_ray=False)
    cm.link = StoppedService()  # type: ignore[assignment]  # in the Ray link's place
    return cm


def test_the_stats_of_a_stopped_service_are_unreachable_parts() -> None:
    stats = stopped_client(shards=2).stats()
    assert isinstance(stats, ServiceStats)
    assert isinstance(stats.controller, Unreachable)
    assert "cmx:controller" in stats.controller.reason
    assert stats.nodes == {} and stats.pool.members == {} and stats.pool.blocks == 0
    assert len(stats.directory) == 2
    assert all(isinstance(d, Unreachable) for d in stats.directory)


def test_the_admin_api_answers_a_stopped_service_as_unavailable() -> None:
    with pytest.raises(UnavailableError, match="controller"):
        ServiceBackend(stopped_client(shards=1)).stats()
