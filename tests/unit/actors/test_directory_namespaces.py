"""A directory shard tags every block with its namespace, however many namespaces it has seen:
a namespace drop must find the blocks of the last tenant as surely as those of the first; and a
shard that may not know every source's blocks yet lists no namespace short."""

from __future__ import annotations

import pytest

from cmx.actors.directory.shard import ApplyResult, DirectoryShard, Entry, Source
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.tiers import Tier

U16 = 1 << 16


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "little") * 8)


def test_blocks_of_more_namespaces_than_sixteen_bits_count_keep_their_tags() -> None:
    shard = DirectoryShard()
    n = U16 + 10
    source = Source("a" * 56, Tier.DRAM)
    shard.resync(source, "e1", n, [Entry(key(i), True, 100, i, f"{i:016x}") for i in range(n)])
    for i in (0, U16 - 2, U16 - 1, n - 1):
        assert [k for k, _ in shard.namespace_blocks(f"{i:016x}")] == [key(i)], i
    shard.check_integrity()


def test_a_shard_lists_no_namespace_until_its_sources_are_in_touch_and_resynced() -> None:
    now = [0.0]
    shard = DirectoryShard(0, heartbeat_s=1.0, resync_s=11.0, clock=lambda: now[0])
    source, ns = Source("a" * 56, Tier.DRAM), "0123456789abcdef"
    with pytest.raises(UnavailableError, match="started"):
        shard.namespace_blocks(ns)  # new: a live source may not have been in touch yet
    now[0] = 2.0
    assert shard.namespace_blocks(ns) == []
    assert shard.apply(source, "e1", 3, []) is ApplyResult.NEED_RESYNC
    with pytest.raises(UnavailableError, match="resyncing dram@aaaaaaaa"):
        shard.namespace_blocks(ns)
    shard.resync(source, "e1", 3, [Entry(key(1), True, 100, 1, ns)])
    assert [k for k, _ in shard.namespace_blocks(ns)] == [key(1)]
    assert shard.apply(source, "e2", 1, []) is ApplyResult.NEED_RESYNC  # the tier restarted
    with pytest.raises(UnavailableError):
        shard.namespace_blocks(ns)
    now[0] += 11.0  # it never resynced (it died): listed from what is known
    assert [k for k, _ in shard.namespace_blocks(ns)] == [key(1)]
