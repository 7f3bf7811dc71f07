"""A directory shard lost for good: killed with no restart, or pinned to a labelled node that
died (Ray cannot schedule it again; its name goes free). The controller starts it again
(actors/directory/placement.py), the tiers resync it, and this node's client, whose link held
the lost actor's handle, finds the new one under the name: lookups are whole again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from conftest import patiently
from pool_support import until
from support import LAYOUT

from cmx.doors import Request
from cmx.links import RAY_NAMESPACE, RayLink, actor_name

T = LAYOUT.block_tokens
BLOCKS = 8


class Named:
    def __init__(self, answer: str) -> None:
        self.answer = answer

    def ask(self) -> str:
        return self.answer


@dataclass(frozen=True)
class Ask(Request[str]):
    method = "ask"
    served_by = (f"{__name__}.Named",)


def gone(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return True
    return False


def test_a_link_finds_the_actor_started_anew_under_a_name(cluster: Any) -> None:
    name = "cmx:test-named:link"
    first = ray.remote(Named).options(name=name, namespace=RAY_NAMESPACE).remote("first")
    link = RayLink(10.0)
    assert link.result(link.submit(name, Ask())) == "first"
    ray.kill(first, no_restart=True)
    assert until(lambda: gone(name))
    second = ray.remote(Named).options(name=name, namespace=RAY_NAMESPACE).remote("second")
    answers = []
    for _ in range(2):  # the first call may still reach the dead actor's handle: it fails
        try:
            answers.append(link.result(link.submit(name, Ask())))
        except Exception as exc:  # noqa: BLE001 - recorded, then asserted on
            answers.append(type(exc).__name__)
    assert answers[-1] == "second", answers
    ray.kill(second, no_restart=True)


def test_a_shard_pinned_to_a_node_that_died_is_started_again(cluster: Any, cm: Any) -> None:
    ns = cm.namespace("m-dir-lost", LAYOUT)
    toks = list(range(7_000, 7_000 + BLOCKS * T))
    assert ns.store(toks, LAYOUT.random_kv(len(toks), seed=71)).wait() == BLOCKS
    assert len(ns.lookup(toks).blocks) == BLOCKS
    name = actor_name("dir", 0)
    labelled = patiently(lambda: cluster.add_node(
        num_cpus=0, labels={cm.config.directory_label: "1"}))
    cluster.wait_for_nodes()
    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"]
                and cm.config.directory_label in (n.get("Labels") or {}))
    try:
        # Shard 0 lost (killed for good): the controller starts it on the labelled node.
        lost = _id(name)
        ray.kill(ray.get_actor(name, namespace=RAY_NAMESPACE), no_restart=True)
        assert until(lambda: _placed(name) == node, 120)
        assert _id(name) != lost
        assert until(lambda: len(ns.lookup(toks).blocks) == BLOCKS, 60)
    finally:
        cluster.remove_node(labelled, allow_graceful=False)
    # Pinned there, it cannot be restarted by Ray once the node is gone: the controller starts
    # it where Ray places it (no labelled node is left), the tiers resync it, and this client,
    # whose link knew the actor Ray could not schedule, finds the new one.
    assert until(lambda: _placed(name) not in (None, node), 180)
    assert until(lambda: len(ns.lookup(toks).blocks) == BLOCKS, 60), \
        f"lookups stop at block {len(ns.lookup(toks).blocks)}"
    assert {c.node for b in ns.lookup(toks).blocks for c in b.copies} == {cm.node_id}


def _id(name: str) -> str:
    return str(ray.get_actor(name, namespace=RAY_NAMESPACE)._actor_id.hex())


def _placed(name: str) -> str | None:
    try:
        actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
        return str(ray.get(actor.placed_on.remote(), timeout=10))
    except Exception:  # noqa: BLE001 - lost, or not started yet
        return None
