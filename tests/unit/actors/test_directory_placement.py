"""Where the directory's shards start (actors/directory/placement.py), without Ray."""

from __future__ import annotations

import pytest

from cmx.actors.directory.placement import shard_node
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
