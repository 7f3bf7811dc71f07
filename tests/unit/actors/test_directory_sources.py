"""A directory shard's source table: wide enough for any churn, and a freed slot reused safely."""

from __future__ import annotations

from cmx.actors.directory.shard import Copy, DirectoryShard, Entry, Source
from cmx.keys import BlockHash
from cmx.tiers import Tier

U16 = 1 << 16


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "little") * 8)


def stored(i: int) -> Entry:
    return Entry(key(i), True, 100, 1000 + i)


def node(i: int) -> str:
    return f"{i:056x}"


def test_more_sources_than_sixteen_bits_count_are_followed() -> None:
    shard = DirectoryShard()
    n = U16 + 10
    for i in range(n):
        shard.resync(Source(node(i), Tier.DRAM), "e1", 1, [stored(i)])
    last = n - 1
    assert shard.lookup([key(last), key(0)]) == [[Copy(Tier.DRAM, node(last), 100, 1000 + last)],
                                                 [Copy(Tier.DRAM, node(0), 100, 1000)]]
    assert shard.stats().sources == n
    shard.check_integrity()


def test_nodes_that_come_and_go_reuse_the_slots_of_those_that_left() -> None:
    shard = DirectoryShard()
    stays = Source(node(0), Tier.NVME)
    shard.resync(stays, "e1", 1, [stored(0)])
    for i in range(1, U16 + 10):  # every raylet restart is a new node id
        gone = Source(node(i), Tier.DRAM)
        shard.resync(gone, "e1", 1, [stored(0), stored(i)])
        assert shard.drop_source(gone) == 2
    assert shard.stats().source_slots == 2
    assert len(shard) == 1
    shard.check_integrity()


def test_a_reused_slot_never_lends_the_new_source_the_old_ones_copies() -> None:
    shard = DirectoryShard()
    a, b, c = (Source(node(i), Tier.DRAM) for i in (1, 2, 3))
    shard.resync(a, "e1", 2, [stored(1), stored(2)])
    shard.resync(b, "e1", 1, [stored(2)])
    assert shard.drop_source(a) == 2
    shard.resync(c, "e1", 1, [stored(3)])  # takes a's slot
    assert shard.stats().source_slots == 2
    assert shard.lookup([key(1), key(2), key(3)]) == [
        [], [Copy(Tier.DRAM, b.node, 100, 1002)], [Copy(Tier.DRAM, c.node, 100, 1003)]]
    assert shard.drop_source(a) == 0  # already gone: c keeps its copies
    assert shard.lookup([key(3)]) == [[Copy(Tier.DRAM, c.node, 100, 1003)]]
    shard.check_integrity()
