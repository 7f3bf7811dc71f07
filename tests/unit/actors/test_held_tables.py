"""A lookup of what this node's memory holds is read from the tiers' held tables, in place:
the same answer as the tiers' books, through commits, evictions, a quarantine while pinned
and a restart, with no call to the tier; the tier is asked where its table cannot be read."""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest
from plane import Plane, make_plane
from scenarios import blocks, check, restart_tier, small_config

from cmx.client.node_plane import NodePlane
from cmx.doors import Request
from cmx.links import LocalLink
from cmx.storage.arena import SHM_DIR
from cmx.tiers import Tier

R = TypeVar("R")
NODE = f"held-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host


class CountingLink(LocalLink):
    """LocalLink that counts the calls made of each method."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.calls: Counter[str] = Counter()

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        self.calls[request.method] += 1
        return super().call(name, request)


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=CountingLink)
    yield p
    p.close()


def stored(plane: Plane, seed: int) -> tuple[list[Any], Any, NodePlane]:
    """One block stored into this node's DRAM: its keys, its payload, and a reader here."""
    keys, payload = blocks(1, seed=seed)
    assert plane.agents[NODE].store(keys, [None], payload) == 1
    return keys, payload, NodePlane(plane.link, NODE, 5.0)


def answer(reader: NodePlane, keys: list[Any]) -> list[set[Tier]]:
    """Per key, the tiers of this node the lookup found it in."""
    return [{c.tier for c in copies} for copies in reader.held(keys).copies]


def books(plane: Plane, keys: list[Any]) -> list[set[Tier]]:
    """The same, asked of the tiers' books."""
    found = {t: plane.tiers[(NODE, t)].held(keys) for t in (Tier.DRAM, Tier.HBM)}
    return [{t for t in found if found[t][i] is not None} for i in range(len(keys))]


def test_lookups_read_the_tables_and_agree_with_the_books_without_a_call(plane: Plane) -> None:
    keys, payload = blocks(6, seed=1)
    agent, reader = plane.agents[NODE], NodePlane(plane.link, NODE, 5.0)
    assert agent.store(keys[:3], [None, *keys[:2]], payload[: 3 * len(payload) // 6]) == 3
    answer(reader, keys)  # maps the tables (one ``info`` per tier)
    calls = plane.link.calls  # type: ignore[attr-defined]
    calls.clear()
    assert answer(reader, keys) == books(plane, keys) == [{Tier.DRAM}] * 3 + [set()] * 3
    plane.tiers[(NODE, Tier.DRAM)].evict(keys[1:2])
    assert answer(reader, keys) == books(plane, keys) == [{Tier.DRAM}, set(), {Tier.DRAM}] + \
        [set()] * 3
    assert calls["held"] == 0 and calls["info"] == 0
    reader.close()
    check(plane)


def test_a_copy_quarantined_while_pinned_is_found_by_no_lookup(plane: Plane) -> None:
    keys, payload, reader = stored(plane, seed=2)
    agent = plane.agents[NODE]
    pins = reader.pin_prefix(keys, "client:reader")
    reader.quarantine(pins)  # pinned: it goes at the last unpin, and is found by none now
    assert answer(reader, keys) == books(plane, keys) == [set()]
    check(plane)
    reader.unpin(pins)
    assert answer(reader, keys) == [set()]
    assert agent.store(keys, [None], payload) == 1  # stored again: found again
    assert answer(reader, keys) == [{Tier.DRAM}]
    reader.close()
    check(plane)


def test_a_restarted_tier_is_read_by_its_new_table_never_the_old_one(plane: Plane) -> None:
    keys, payload, reader = stored(plane, seed=3)
    agent = plane.agents[NODE]
    assert answer(reader, keys) == [{Tier.DRAM}]
    old = plane.tiers[(NODE, Tier.DRAM)].held_keys.table.name
    restart_tier(plane, NODE, Tier.DRAM)  # empty; the old incarnation's names are unlinked
    assert not os.path.exists(os.path.join(SHM_DIR, old))
    assert answer(reader, keys) == [set()]
    assert agent.store(keys, [None], payload) == 1
    assert answer(reader, keys) == [{Tier.DRAM}]
    reader.close()
    check(plane)


def test_a_tier_whose_table_cannot_be_read_is_asked(plane: Plane) -> None:
    keys, _, reader = stored(plane, seed=4)
    calls = plane.link.calls  # type: ignore[attr-defined]
    dram = plane.tiers[(NODE, Tier.DRAM)]
    dram.held_keys.table.close()  # closed under its readers: they ask the tier
    calls.clear()
    assert answer(reader, keys) == [{Tier.DRAM}]
    assert calls["held"] == 1
    reader.close()
