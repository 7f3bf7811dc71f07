"""A shard's answer for many keys at once (``find_copies``: keys in one buffer, one table back)
is its ``lookup``, copy for copy and in the same order, through stores, removals, sources that
leave and slots reused, and after crossing a process boundary (pickled, as Ray sends it)."""

from __future__ import annotations

import pickle
import random

from cmx.actors.directory.shard import DirectoryShard, Entry, Source
from cmx.keys import BlockHash
from cmx.tiers import Tier


def churned_shard(rng: random.Random, keys: list[BlockHash]) -> DirectoryShard:
    shard = DirectoryShard()
    sources = [Source(f"{n:056x}", t) for n in range(4)
               for t in (Tier.HBM, Tier.DRAM, Tier.NVME)]
    seq = {s: 0 for s in sources}
    epoch = {s: "e0" for s in sources}
    for s in sources:
        shard.resync(s, epoch[s], 0, [])
    for step in range(3000):
        source = rng.choice(sources)
        key = rng.choice(keys)
        entry = Entry(key, rng.random() < 0.7, size=1 + (key[0] << 8),
                      checksum=int.from_bytes(key[:8], "little") | 1 << 63)
        seq[source] += 1
        assert shard.apply(source, epoch[source], seq[source], [entry]).value == "ok"
        if step % 700 == 699:  # a node leaves; its slot goes to the next source
            gone = rng.choice(sources)
            shard.drop_source(gone)
            epoch[gone] = f"e{step}"
            shard.resync(gone, epoch[gone], seq[gone], [])
    shard.check_integrity()
    return shard


def test_find_copies_answers_what_lookup_answers() -> None:
    rng = random.Random(5)
    keys = [BlockHash(rng.randbytes(32)) for _ in range(300)]
    shard = churned_shard(rng, keys)
    asked = keys + [BlockHash(rng.randbytes(32)) for _ in range(20)]  # some never stored
    rng.shuffle(asked)
    want = shard.lookup(asked)
    assert any(want) and not all(want)  # hits with one copy and with several, and misses
    assert any(len(c) > 1 for c in want)
    table = shard.find_copies(b"".join(asked))
    assert table.lists() == want
    assert pickle.loads(pickle.dumps(table)).lists() == want


def test_no_keys_and_only_misses() -> None:
    shard = churned_shard(random.Random(2), [BlockHash(b"k" * 32)])
    assert shard.find_copies(b"").lists() == []
    assert shard.find_copies(b"x" * 64).lists() == [[], []]
