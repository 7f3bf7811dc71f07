"""Where the directory's shards start (actors/directory/placement.py), and that the
controller's rounds start them whatever else fails, without Ray."""

from __future__ import annotations

import threading

import pytest
from ray.exceptions import GetTimeoutError

from cmx.actors import service
from cmx.actors.directory.placement import shard_node
from cmx.actors.service import Controller
from cmx.config import ServiceConfig

CONFIG = ServiceConfig()
LABEL = CONFIG.directory_label


def nodes(**labels: dict[str, str]) -> dict[str, dict[str, object]]:
    return {node: {"NodeID": node, "Labels": dict(own)} for node, own in labels.items()}


def test_no_labelled_node_leaves_the_placement_to_ray() -> None:
    alive = nodes(a={}, b={"cmx.io/pool": "p1"})
    assert [shard_node(i, CONFIG, alive) for i in range(3)] == [None, None, None]
    assert shard_node(0, CONFIG, {}) is None


def test_shards_go_round_robin_over_the_labelled_nodes_in_node_id_order() -> None:
    alive = nodes(c={LABEL: "1"}, a={}, b={LABEL: ""})
    assert [shard_node(i, CONFIG, alive) for i in range(4)] == ["b", "c", "b", "c"]


def test_the_label_is_the_configured_one() -> None:
    alive = nodes(a={LABEL: "1"}, b={"dir-here": "1"})
    assert shard_node(0, CONFIG.replace(directory_label="dir-here"), alive) == "b"
    assert shard_node(0, CONFIG, {"a": {"NodeID": "a", "Labels": None}}) is None


def test_a_negative_shard_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="shard -1 is negative"):
        shard_node(-1, CONFIG, nodes(a={LABEL: "1"}))


class _Rounds(Controller):
    """The controller's rounds, without its thread or a cluster."""

    def __init__(self) -> None:
        self.config = CONFIG
        self.known: set[str] = set()
        self.pool: set[str] = set()
        self.agent_on: dict[str, str] = {}
        self._lock = threading.Lock()


def test_a_node_whose_actors_cannot_start_does_not_keep_a_lost_shard_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[dict[str, object]] = []

    def cannot_start(node_id: str, *_: object) -> None:
        raise GetTimeoutError(f"the actors of {node_id} did not start")

    monkeypatch.setattr(service, "alive_nodes", lambda: list(nodes(a={LABEL: "1"}).values()))
    monkeypatch.setattr(service, "start_node_actors", cannot_start)
    monkeypatch.setattr(service, "start_shards",
                        lambda config, alive, options: started.append(dict(alive)) or [0])
    rounds = _Rounds()
    for _ in range(2):  # every round fails on the node, and starts the shards all the same
        with pytest.raises(GetTimeoutError):
            rounds.reconcile()
    assert [list(alive) for alive in started] == [["a"], ["a"]]
    monkeypatch.setattr(service, "start_shards", lambda *_: (_ for _ in ()).throw(
        RuntimeError("no labelled node can take it")))
    monkeypatch.setattr(service, "start_node_actors", lambda *_: None)
    rounds._place_agents = lambda alive: []  # type: ignore[method-assign]
    rounds._reconcile_pool = lambda alive: []  # type: ignore[method-assign]
    assert rounds.reconcile()["started"] == ["a"]  # a failed shard start costs the node nothing
