"""A directory shard tags every block with its namespace, however many namespaces it has seen:
a namespace drop must find the blocks of the last tenant as surely as those of the first."""

from __future__ import annotations

from cmx.actors.directory.shard import DirectoryShard, Entry, Source
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
