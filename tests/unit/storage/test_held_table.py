"""HeldTable: a tier's committed keys in shared memory, read in place by another mapping."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest

from cmx.keys import KEY_BYTES
from cmx.storage import held_table
from cmx.storage.held_table import HeldTable


@pytest.fixture
def table() -> Iterator[HeldTable]:
    t = HeldTable.create(f"cmx-test-held-{uuid.uuid4().hex[:8]}", 40)  # 128 entries
    yield t
    t.unlink()


def crowded_key(rng: random.Random) -> bytes:
    """A key whose home is one of 4 entries: long runs, wrapping past the table's end."""
    home = rng.choice([0, 1, 126, 127])
    return home.to_bytes(8, "little") + rng.randbytes(KEY_BYTES - 8)


def test_a_reader_sees_exactly_what_the_writer_holds_through_puts_and_removes(
        table: HeldTable) -> None:
    reader = HeldTable.attach(table.name)
    rng = random.Random(7)
    model: dict[bytes, tuple[int, int]] = {}
    pool = [crowded_key(rng) for _ in range(60)]
    for step in range(3000):
        key = rng.choice(pool)
        if key in model and rng.random() < 0.5:
            table.remove(key)
            del model[key]
        elif key in model or len(model) < 40:
            model[key] = (rng.randrange(1, 1 << 21), rng.randrange(1 << 64))
            table.put(key, *model[key])
        if step % 50 == 0 or step > 2950:
            assert reader.find(pool) == [model.get(k) for k in pool], step
    assert len(reader) == len(model)
    reader.arena.close()


def test_a_size_of_zero_and_the_largest_checksum_are_held(table: HeldTable) -> None:
    key = bytes(range(KEY_BYTES))
    table.put(key, 0, (1 << 64) - 1)
    assert table.find([key, bytes(KEY_BYTES)]) == [(0, (1 << 64) - 1), None]
    table.remove(key)
    table.remove(key)  # removing what is not held changes nothing
    assert table.find([key]) == [None] and len(table) == 0


def test_a_read_during_a_write_is_given_up_not_believed(table: HeldTable) -> None:
    key = bytes(range(KEY_BYTES))
    table.put(key, 5, 6)
    table._head[0] += 1  # a write under way in another process: the version is odd
    assert table.find([key]) is None
    table._head[0] += 1
    assert table.find([key]) == [(5, 6)]


def test_a_closed_or_overfilled_table_sends_readers_to_the_tier(table: HeldTable) -> None:
    rng = random.Random(3)
    keys = [rng.randbytes(KEY_BYTES) for _ in range(65)]
    for k in keys[:64]:
        table.put(k, 1, 1)
    assert table.find(keys[:64]) == [(1, 1)] * 64
    table.put(keys[64], 1, 1)  # past half full: more keys than it was sized for
    assert table.find(keys) is None
    table.put(keys[0], 2, 2)  # a closed table takes no writes
    assert table.find([keys[0]]) is None


def test_a_table_whose_name_was_unlinked_cannot_be_attached(table: HeldTable) -> None:
    name = table.name
    table.unlink()
    with pytest.raises(OSError):
        HeldTable.attach(name)


@pytest.mark.parametrize("few", [0, 8, held_table._FEW])  # runs probed a step a pass, or at once
def test_columns_in_bulk_say_what_find_says_key_by_key(
        table: HeldTable, few: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``find_columns`` (one buffer of keys, a lookup of a long prefix) against ``find`` and
    the writer's model, through puts and removes that wrap around the table's end."""
    monkeypatch.setattr(held_table, "_FEW", few)
    reader = HeldTable.attach(table.name)
    rng = random.Random(11)
    model: dict[bytes, tuple[int, int]] = {}
    pool = [crowded_key(rng) for _ in range(60)]
    for step in range(600):
        key = rng.choice(pool)
        if key in model and rng.random() < 0.5:
            table.remove(key)
            del model[key]
        elif key in model or len(model) < 40:
            model[key] = (rng.randrange(0, 1 << 21), rng.randrange(1 << 64))
            table.put(key, *model[key])
        if step % 25 == 0:
            found = reader.find_columns(b"".join(pool))
            assert found is not None
            held, sizes, sums = found
            assert [(int(s), int(c)) if h else None for h, s, c in zip(held, sizes, sums)] == \
                [model.get(k) for k in pool] == reader.find(pool), step
    table.close()
    assert reader.find_columns(b"".join(pool)) is None  # closed: ask the tier
    reader.arena.close()
