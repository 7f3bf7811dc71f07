"""Routing: least-loaded of two, or the prefix's home replica within a slack."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from cmx.simulate import SimConfig, Simulator
from cmx.simulate.cluster import Replica
from cmx.simulate.routing import Router, load

Configs = Callable[..., SimConfig]


def _replicas(n: int) -> list[Replica]:
    return [Replica(i, None, 1.0) for i in range(n)]  # type: ignore[arg-type]


def test_one_prefix_goes_home_until_home_is_slack_requests_busier() -> None:
    replicas = _replicas(8)
    router = Router(replicas, "prefix", arrivals=100, seed=0, slack=2)
    sent = []
    for i in range(100):
        r = router.route(i, prefix=7)
        r.queue.append(i)  # nothing completes: each request adds to its replica's load
        sent.append(r.index)
    home = max(set(sent), key=sent.count)
    # Home takes requests while it is within 2 of the less loaded of the two drawn ...
    assert sent[:3] == [home] * 3
    # ... so it never runs more than 3 (the slack, and the one it took) past every other.
    others = [load(r) for r in replicas if r.index != home]
    assert load(replicas[home]) <= max(others) + 3
    assert load(replicas[home]) > max(others)  # the prefix's requests do prefer it
    assert len(set(sent)) == 8  # a hot prefix does not pin one replica


def test_least_loaded_ignores_the_prefix() -> None:
    a = Router(_replicas(8), "least-loaded", arrivals=50, seed=3)
    b = Router(_replicas(8), "least-loaded", arrivals=50, seed=3)
    assert [a.route(i, 1).index for i in range(50)] == [b.route(i, 99).index for i in range(50)]


def test_an_unknown_routing_or_a_negative_slack_is_refused(make_config: Configs) -> None:
    with pytest.raises(ValueError, match="unknown routing"):
        Router(_replicas(2), "round-robin", arrivals=1, seed=0)
    with pytest.raises(ValueError, match="slack"):
        Router(_replicas(2), "prefix", arrivals=1, seed=0, slack=-1)
    with pytest.raises(ValueError, match="unknown routing"):
        replace(make_config(), routing="nearest")


def test_prefix_routing_finds_more_of_each_prefix_in_the_nodes_own_hbm(
    make_config: Configs,
) -> None:
    base = make_config(pool_nodes=0, nodes=4)
    spread = Simulator(base)
    r_spread = spread.run()
    homed = Simulator(replace(base, routing="prefix"))
    r_homed = homed.run()
    homed.cluster.check_integrity()
    assert r_homed.completed == r_spread.completed == r_homed.requests
    local = r_homed.loaded_bytes.get("hbm", 0) / sum(r_homed.loaded_bytes.values())
    local_spread = r_spread.loaded_bytes.get("hbm", 0) / sum(r_spread.loaded_bytes.values())
    assert local > local_spread
