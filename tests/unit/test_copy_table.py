"""A CopyTable says exactly what the lists of copies it stands for say: every operation a lookup
makes on the columns gives what the same operation on the lists gives, and its best copy is
``best_copy``'s, ties and all."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cmx.copy_table import CopyTable
from cmx.protocol import Copy, best_copy, shard_of, shards_of
from cmx.tiers import Tier

NODES = ("here", "peer-1", "peer-2")


def random_lists(rng: random.Random, keys: int) -> list[list[Copy]]:
    """Per key, up to five copies in distinct places, in a random order; some keys none."""
    places = [(t, n) for t in (Tier.HBM, Tier.DRAM, Tier.NVME, Tier.POOL) for n in NODES]
    out = []
    for _ in range(keys):
        size, checksum = rng.randrange(1, 1 << 30), rng.randrange(1 << 64)
        out.append([Copy(t, n, size, checksum)
                    for t, n in rng.sample(places, rng.choice([0, 1, 1, 2, 3, 5]))])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_table_gives_back_its_lists_and_the_best_copy_of_each(seed: int) -> None:
    rng = random.Random(seed)
    lists = random_lists(rng, 200)
    table = CopyTable.of(lists)
    assert table.lists() == lists
    for node in (*NODES, "elsewhere"):
        best = table.best(node)
        for i, copies in enumerate(lists):
            if not copies:
                assert best[i] == -1
                continue
            row = int(best[i])
            tier, where = table.places[table.place[row]]
            assert Copy(tier, where, int(table.size[row]), int(table.checksum[row])) == \
                best_copy(copies, node)
            assert row - table.starts[i] == copies.index(best_copy(copies, node))  # the first


def test_of_two_equal_copies_elsewhere_the_first_listed_is_best() -> None:
    lists = [[Copy(Tier.DRAM, "peer-2", 1, 2), Copy(Tier.DRAM, "peer-1", 1, 2)],
             [Copy(Tier.NVME, "peer-1", 1, 2), Copy(Tier.DRAM, "peer-2", 1, 2),
              Copy(Tier.DRAM, "peer-1", 1, 2)]]
    assert CopyTable.of(lists).best("here").tolist() == [0, 3]


@pytest.mark.parametrize("seed", range(4))
def test_head_take_where_stack_and_merge_do_what_they_do_to_lists(seed: int) -> None:
    rng = random.Random(seed)
    lists, other = random_lists(rng, 120), random_lists(rng, 30)
    table = CopyTable.of(lists)
    prefix = next((i for i, c in enumerate(lists) if not c), len(lists))
    assert table.prefix() == prefix
    assert table.head(prefix).lists() == lists[:prefix]
    order = np.array(rng.sample(range(120), 50), np.int64)
    assert table.take(order).lists() == [lists[i] for i in order]
    keep = np.array([rng.random() < 0.6 for _ in range(len(table.place))])
    kept = iter(keep.tolist())
    assert table.where(keep).lists() == [[c for c in copies if next(kept)] for copies in lists]
    assert CopyTable.stack([table, CopyTable.empty(2), CopyTable.of(other)]).lists() == \
        lists + [[], []] + other
    # three parts answer keys spread over 160, in their own orders; key 7 nobody answers
    spread = rng.sample([k for k in range(160) if k != 7], 150)
    parts = [(np.array(spread[:120], np.int64), table),
             (np.array(spread[120:], np.int64), CopyTable.of(other))]
    want: list[list[Copy]] = [[] for _ in range(160)]
    for at, copies in zip(spread, lists + other):
        want[at] = copies
    assert CopyTable.merge(parts, 160).lists() == want
    assert CopyTable.merge([], 0).lists() == []


def test_no_keys_and_keys_with_no_copy() -> None:
    assert CopyTable.of([]).lists() == [] and CopyTable.empty(3).lists() == [[], [], []]
    assert CopyTable.empty(3).prefix() == 0 and CopyTable.of([]).prefix() == 0
    assert CopyTable.empty(2).best("here").tolist() == [-1, -1]
    assert CopyTable.stack([]).lists() == []


def test_shards_of_a_buffer_of_keys_are_shard_of_each() -> None:
    rng = random.Random(1)
    keys = [rng.randbytes(32) for _ in range(500)]
    rows = np.frombuffer(b"".join(keys), np.uint8).reshape(-1, 32)
    for shards in (1, 2, 3, 7):
        assert shards_of(rows, shards).tolist() == [shard_of(k, shards) for k in keys]
