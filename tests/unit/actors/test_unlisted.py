"""A copy committed not ``listed`` (a scan's window staged in HBM) never reaches the directory:
not its storing, not its removal, not a resync of the tier's holdings while it is held. A
listed copy of the same key stored after it goes is published as ever, and a commit that fails
leaves the key listed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from plane import Plane, make_plane
from scenarios import BLOCK, Sent, check, small_config

from cmx.protocol import shard_of
from cmx.tiers import Tier

NODE = f"unlisted-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path, hbm_bytes=8 * BLOCK), nodes=(NODE,))
    yield p
    p.close()


def key_of(n: int) -> bytes:
    return uuid.uuid5(uuid.NAMESPACE_OID, f"{NODE}-{n}").bytes * 2


def commit(hbm: Any, key: bytes, listed: bool, owner: str = "reader") -> Any:
    grant = hbm.reserve([(key, None)], owner)[0]
    assert grant is not None
    pin = hbm.commit_pinned([(grant.lease, BLOCK, 7)], owner=owner, listed=listed)[0]
    assert pin is not None
    return pin


def tiers_listing(plane: Plane, key: bytes) -> set[Tier]:
    return {c.tier for c in plane.lookup([key])[0]}


def test_an_unlisted_copy_is_never_sent_stored_or_removed(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    hbm = plane.tiers[(NODE, Tier.HBM)]
    sent = Sent(plane, monkeypatch)
    key = key_of(0)
    pin = commit(hbm, key, listed=False)
    assert tiers_listing(plane, key) == set()
    hbm.unpin([pin.lease])
    assert hbm.evict([key]) == 1
    hbm.publisher.flush(heartbeat=True)
    assert sent.of(key) == []
    # The same key stored listed after the unlisted copy went: published, and its removal too.
    pin = commit(hbm, key, listed=True)
    assert tiers_listing(plane, key) == {Tier.HBM}
    hbm.unpin([pin.lease])
    assert hbm.evict([key]) == 1
    hbm.publisher.flush()
    assert sent.of(key) == [(key, True), (key, False)]
    assert tiers_listing(plane, key) == set()
    check(plane)


def test_a_resync_leaves_out_the_unlisted_copies_held(plane: Plane) -> None:
    hbm = plane.tiers[(NODE, Tier.HBM)]
    hidden, shown = key_of(1), key_of(2)
    commit(hbm, hidden, listed=False)
    commit(hbm, shown, listed=True)
    for key in (hidden, shown):
        hbm.publisher._resync(shard_of(key, len(plane.shards)))
    assert tiers_listing(plane, hidden) == set()
    assert tiers_listing(plane, shown) == {Tier.HBM}
    check(plane)


def test_a_commit_that_fails_gives_its_slot_back_and_leaves_the_key_listed(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store refuses the commit (its lease already taken): the slot goes back at once,
    and the key stored again after, listed, is published."""
    hbm = plane.tiers[(NODE, Tier.HBM)]
    key = key_of(3)
    grant = hbm.reserve([(key, None)], "reader")[0]
    store_commit = hbm.store.commit

    def failing(*args: Any) -> None:
        raise OSError("the arena is gone")

    monkeypatch.setattr(hbm.store, "commit", failing)
    with pytest.raises(OSError):
        hbm.commit_pinned([(grant.lease, BLOCK, 7)], owner="reader", listed=False)
    monkeypatch.setattr(hbm.store, "commit", store_commit)
    assert hbm.stats().reserved == 0
    check(plane)
    commit(hbm, key, listed=True)
    assert tiers_listing(plane, key) == {Tier.HBM}
    check(plane)


def test_an_unlisted_copy_read_beyond_its_scan_is_published(plane: Plane) -> None:
    """Another reader pins the copy a scan staged: it is published then, and its removal
    after; the scan's own pin published nothing."""
    hbm = plane.tiers[(NODE, Tier.HBM)]
    key = key_of(4)
    hbm.unpin([commit(hbm, key, listed=False).lease])
    assert tiers_listing(plane, key) == set()
    pin = hbm.pin([key], "another")[0]
    assert pin is not None
    assert tiers_listing(plane, key) == {Tier.HBM}
    hbm.unpin([pin.lease])
    assert hbm.evict([key]) == 1
    assert tiers_listing(plane, key) == set()
    check(plane)


def test_a_prefetch_that_finds_an_unlisted_copy_returns_once_lookups_see_it(
        plane: Plane) -> None:
    hbm = plane.tiers[(NODE, Tier.HBM)]
    key = key_of(5)
    hbm.unpin([commit(hbm, key, listed=False).lease])
    assert plane.agents[NODE].prefetch([key], [[]]) == 1
    assert tiers_listing(plane, key) == {Tier.HBM}
    check(plane)


def test_a_commit_that_raises_once_stored_keeps_its_copy_unlisted_until_read(
        plane: Plane) -> None:
    """A step after the store's commit raises (a subscriber of its events): the copy stays
    committed, so it is not aborted, and stays unlisted until another reader pins it."""
    hbm = plane.tiers[(NODE, Tier.HBM)]
    key = key_of(6)
    raised = []

    def refusing(event: Any) -> None:
        if event.key == key and not raised:
            raised.append(event)
            raise RuntimeError("a subscriber failed")

    hbm.store.subscribe(refusing)
    grant = hbm.reserve([(key, None)], "reader")[0]
    with pytest.raises(RuntimeError):
        hbm.commit_pinned([(grant.lease, BLOCK, 7)], owner="reader", listed=False)
    assert hbm.contains([key]) == [True]
    assert tiers_listing(plane, key) == set()
    pin = hbm.pin([key], "another")[0]
    assert pin is not None
    assert tiers_listing(plane, key) == {Tier.HBM}
    hbm.unpin([pin.lease])
    check(plane)
