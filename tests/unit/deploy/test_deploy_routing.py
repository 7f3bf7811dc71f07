"""Prefix-aware routing as a plain function: where the prefix is, against queue lengths."""

from __future__ import annotations

import random

from cmx.deploy.routing import CopySeen, ReplicaView, best_source, rank_replicas

MiB = 1 << 20
PREFILL = (1e-3, 0.0, 0.0)  # 1 ms per token on every replica


def prefix(node: str, tier: str = "dram", blocks: int = 15) -> list[list[CopySeen]]:
    return [[CopySeen(tier, node, 2 * MiB)] for _ in range(blocks)]


def view(rid: str, node: str, queue: int = 0, per_request_s: float = 1.0) -> ReplicaView:
    return ReplicaView(rid, node, queue, per_request_s, PREFILL)


def order(replicas: list[ReplicaView], where: list[list[CopySeen]], tokens: int = 4096) -> list:
    return [r.replica_id for r in rank_replicas(replicas, where, 256, tokens, 256,
                                                random.Random(0))]


def test_the_best_source_is_the_nodes_own_fastest_copy_else_a_peers() -> None:
    copies = [CopySeen("nvme", "a", 1), CopySeen("dram", "b", 1), CopySeen("hbm", "a", 1)]
    assert best_source(copies, "a") == "hbm"
    assert best_source(copies, "b") == "dram"
    assert best_source(copies, "c") == "hbm@peer"
    assert best_source([], "a") is None


def test_the_replica_whose_node_holds_the_prefix_in_memory_wins_at_equal_queues() -> None:
    replicas = [view("r1", "a"), view("r2", "b")]
    assert order(replicas, prefix("b"))[0] == "r2"
    assert order(replicas, prefix("a"))[0] == "r1"


def test_a_faster_tier_beats_a_slower_one() -> None:
    where = [[CopySeen("nvme", "a", 2 * MiB), CopySeen("dram", "b", 2 * MiB)]] * 15
    assert order([view("r1", "a"), view("r2", "b")], where)[0] == "r2"


def test_a_long_queue_outweighs_a_cheap_load() -> None:
    # Loading from the peer costs ~0.1 s more; 3 requests of 2 s ahead cost 6 s.
    replicas = [view("r1", "a", queue=3, per_request_s=2.0), view("r2", "b")]
    assert order(replicas, prefix("a"))[0] == "r2"
    replicas = [view("r1", "a", queue=0), view("r2", "b", queue=1, per_request_s=0.001)]
    assert order(replicas, prefix("a"))[0] == "r1"


def test_without_a_cached_prefix_the_shortest_queue_wins_and_ties_are_shuffled() -> None:
    assert order([view("r1", "a", queue=2), view("r2", "b", queue=1)], [])[0] == "r2"
    firsts = {r.replica_id for seed in range(20) for r in rank_replicas(
        [view("r1", "a"), view("r2", "b")], [], 256, 1000, 256, random.Random(seed))[:1]}
    assert firsts == {"r1", "r2"}


def test_each_replica_is_priced_with_its_own_measurements() -> None:
    slow_links = {"dram@peer": (5.0, 1e6)}  # r2 measured its peer link as hopeless
    r1 = view("r1", "a")
    r2 = ReplicaView("r2", "b", 0, 1.0, PREFILL, slow_links)
    routes = rank_replicas([r1, r2], prefix("a"), 256, 4096, 256, random.Random(0))
    assert routes[0].replica_id == "r1" and routes[0].load_tokens == 3840
    assert routes[1].load_tokens == 0  # r2 would recompute rather than use that link
