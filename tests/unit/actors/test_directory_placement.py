"""Where the directory's shards start (actors/directory/placement.py), and that the
controller's rounds start them whatever else fails, without Ray."""

from __future__ import annotations

import threading

import pytest
from ray.exceptions import GetTimeoutError

from cmx.actors import service
from cmx.actors.directory.placement import SHARD_AVOID_S, SHARD_SILENT_S, ShardWatch, shard_node
from cmx.actors.directory.shard import DirectoryShard, Entry, Source
from cmx.actors.service import Controller
from cmx.config import ServiceConfig
from cmx.doors import Request
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.links import LocalLink, actor_name
from cmx.tiers import Tier

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
        self.pool_generation = 0
        self.unforgotten: dict[str, set[tuple[int, Tier]]] = {}
        self.clock = 0.0
        self.shard_watch = ShardWatch(clock=lambda: self.clock)
        self._lock = threading.Lock()


def test_a_node_whose_actors_cannot_start_does_not_keep_a_lost_shard_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[dict[str, object]] = []

    def cannot_start(node_id: str, *_: object) -> None:
        raise GetTimeoutError(f"the actors of {node_id} did not start")

    monkeypatch.setattr(service, "alive_nodes", lambda: list(nodes(a={LABEL: "1"}).values()))
    monkeypatch.setattr(service, "start_node_actors", cannot_start)
    monkeypatch.setattr(service, "start_shards",
                        lambda config, alive, options, avoid: started.append(dict(alive)) or [0])
    monkeypatch.setattr(service, "ping_shards", lambda config: {})
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


def test_a_shard_that_missed_a_nodes_departure_is_told_again_until_it_hears(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A node leaves; one shard does not answer the controller's ``drop_source`` in time. It
    must be told on a later round, or it lists the node's copies for as long as it runs."""
    key = BlockHash(bytes(range(32)))
    shards = {actor_name("dir", i): DirectoryShard(i) for i in range(CONFIG.directory_shards)}
    for shard in shards.values():
        shard.resync(Source("gone", Tier.DRAM), "e1", 1, [Entry(key, True, 10, 7)])
    late = actor_name("dir", CONFIG.directory_shards - 1)
    down = {late}

    class Link(LocalLink):
        def __init__(self, timeout_s: float) -> None:
            super().__init__(shards)

        def call(self, name: str, request: Request[object],
                 timeout_s: float | None = None) -> object:
            if name in down:
                raise UnavailableError(f"{name}.{request.method} did not answer: timed out")
            return super().call(name, request)

    def no_actor(*_: object, **__: object) -> None:
        raise ValueError("no such actor")  # the node's actors went with it

    monkeypatch.setattr(service, "RayLink", Link)
    monkeypatch.setattr(service.ray, "get_actor", no_actor)
    monkeypatch.setattr(service, "alive_nodes", lambda: [])
    monkeypatch.setattr(service, "start_shards", lambda *_: [])
    monkeypatch.setattr(service, "ping_shards", lambda config: {})
    rounds = _Rounds()
    rounds.known = {"gone"}
    rounds._place_agents = lambda alive: []  # type: ignore[method-assign]
    rounds._reconcile_pool = lambda alive: []  # type: ignore[method-assign]
    assert rounds.reconcile()["gone"] == ["gone"]
    assert [bool(s.lookup([key])[0]) for s in shards.values()] == \
        [name == late for name in shards]
    down.clear()
    assert rounds.reconcile()["gone"] == []  # the node is not seen again; its copies still go
    assert not any(s.lookup([key])[0] for s in shards.values())
    assert rounds.unforgotten == {}


def test_a_shard_pinned_to_a_labelled_node_that_cannot_run_it_is_moved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Node "a" is labelled and alive, but shard 0, pinned there, never answers (Ray keeps it
    pending or restarting there, under its name: ``start_shards`` finds it running). After
    ``SHARD_SILENT_S`` it is stopped and started on "b", and "a" takes no shard for a while."""
    alive = nodes(a={LABEL: "1"}, b={LABEL: "1"})
    running: dict[int, str] = {}
    stopped: list[int] = []

    def start(config: ServiceConfig, alive: dict[str, dict[str, object]], options: object,
              avoid: frozenset[str]) -> list[int]:
        new = [i for i in range(config.directory_shards) if i not in running]
        for i in new:
            node = shard_node(i, config, alive, avoid)
            assert node is not None
            running[i] = node
        return new

    def stop(shard: int) -> None:
        stopped.append(shard)
        del running[shard]

    monkeypatch.setattr(service, "alive_nodes", lambda: list(alive.values()))
    monkeypatch.setattr(service, "start_node_actors", lambda *_: None)
    monkeypatch.setattr(service, "start_shards", start)
    monkeypatch.setattr(service, "stop_shard", stop)
    monkeypatch.setattr(service, "ping_shards", lambda config: {
        i: (None if node == "a" else node) for i, node in running.items()})
    rounds = _Rounds()
    rounds._place_agents = lambda alive: []  # type: ignore[method-assign]
    rounds._reconcile_pool = lambda alive: []  # type: ignore[method-assign]
    rounds.reconcile()
    on_a = sorted(i for i, node in running.items() if node == "a")
    assert on_a == [i for i in range(CONFIG.directory_shards)
                    if shard_node(i, CONFIG, alive) == "a"] != []
    rounds.clock += SHARD_SILENT_S - 1
    rounds.reconcile()
    assert stopped == []  # silent, but not for long yet
    rounds.clock += 1
    rounds.reconcile()
    assert stopped == on_a
    rounds.reconcile()  # started again, away from "a"
    assert set(running.values()) == {"b"} and set(running) == set(range(CONFIG.directory_shards))
    rounds.clock += SHARD_AVOID_S
    assert rounds.shard_watch.avoid() == frozenset()


def test_a_shard_that_answers_is_never_moved() -> None:
    now = [0.0]
    watch = ShardWatch(silent_s=10.0, avoid_s=100.0, clock=lambda: now[0])
    watch.started({0: "a", 1: "b"})
    assert watch.heard({0: "a", 1: None}) == []
    now[0] = 9.0
    assert watch.heard({0: "a", 1: "b"}) == []  # busy a while, then answered: stays
    now[0] = 30.0
    assert watch.heard({0: "a", 1: None}) == []
    assert watch.avoid() == frozenset()
