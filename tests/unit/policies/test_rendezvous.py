"""Rendezvous hashing: stable owners, minimal movement when members change."""

from __future__ import annotations

import hashlib

import pytest

from cmx.policies.rendezvous import owners

KEYS = [hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest() for i in range(2000)]
MEMBERS = ["p1", "p2", "p3", "p4"]


def test_owners_are_distinct_deterministic_and_spread() -> None:
    counts = dict.fromkeys(MEMBERS, 0)
    for key in KEYS:
        got = owners(key, MEMBERS, 2)
        assert len(set(got)) == 2 and got == owners(key, list(reversed(MEMBERS)), 2)
        for m in got:
            counts[m] += 1
    assert all(800 < c < 1200 for c in counts.values()), counts  # 1000 each on average


def test_a_member_leaving_moves_only_its_own_blocks() -> None:
    for key in KEYS:
        before = owners(key, MEMBERS, 2)
        after = owners(key, [m for m in MEMBERS if m != "p3"], 2)
        if "p3" not in before:
            assert after == before
        else:
            assert [m for m in before if m != "p3"][0] in after


def test_fewer_members_than_replicas_and_bad_input() -> None:
    assert owners(KEYS[0], ["p1"], 3) == ["p1"]
    assert owners(KEYS[0], [], 2) == []
    with pytest.raises(ValueError, match="replicas"):
        owners(KEYS[0], MEMBERS, 0)
