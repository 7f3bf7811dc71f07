"""A client's store copies each block once into its slot; the checksum it commits is of the
engine's bytes, in the slot's payload order, whatever the engine tensor's strides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cmx.checksum import checksum
from cmx.client.stores import copy_block
from cmx.layout import KVLayout, PayloadOrder


@pytest.mark.parametrize("order", list(PayloadOrder))
@pytest.mark.parametrize("strides", ["window", "contiguous", "token_minor"])
def test_copy_block_writes_the_payload_and_checksums_the_source_in_its_order(
    order: PayloadOrder, strides: str
) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                      block_tokens=4, order=order)
    kv = layout.random_kv(3 * layout.block_tokens, seed=1)
    src = kv[:, :, :, 4:8]  # a block in the middle of the engine's window: strided
    if strides == "contiguous":
        src = src.contiguous()
    elif strides == "token_minor":
        src = src.transpose(3, 4).contiguous().transpose(3, 4)
    slot = np.zeros(layout.block_bytes, np.uint8)
    csum = copy_block(layout, slot, src)
    assert torch.equal(layout.from_payload(slot), src)
    assert csum == checksum(slot)


def test_copy_block_checksums_the_source_not_what_the_slot_holds_after() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)
    kv = layout.random_kv(4, seed=2)
    slot = np.zeros(layout.block_bytes, np.uint8)
    csum = copy_block(layout, slot, kv)
    slot[0] ^= 0xFF  # a late writer's byte lands
    assert csum != checksum(slot)
    assert csum == checksum(layout.to_payload(kv).contiguous())


@pytest.mark.parametrize("strides", ["window", "contiguous"])
def test_a_run_of_small_blocks_is_gathered_as_each_block_alone_would_be(strides: str) -> None:
    from cmx.client.stores import TensorSource

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                      block_tokens=4)
    kv = layout.random_kv(12 * layout.block_tokens, seed=3)
    if strides == "window":  # the engine's blocks 2..9 of a wider tensor: strided
        kv = kv[:, :, :, 2 * layout.block_tokens : 10 * layout.block_tokens]
    source = TensorSource(layout, kv)
    rows, sums = source.copy_run(1, 5)
    assert rows.shape == (5, layout.block_bytes) and rows.flags.c_contiguous
    for j in range(5):
        slot = np.zeros(layout.block_bytes, np.uint8)
        assert sums[j] == source.copy_block(1 + j, slot)
        assert np.array_equal(rows[j], slot)


def test_a_run_is_written_only_into_slots_the_arena_has_and_that_hold_it() -> None:
    from types import SimpleNamespace

    from cmx.client.stores import _write_run
    from cmx.errors import LayoutMismatchError

    buffer = np.zeros(4 * 64, np.uint8)
    arena = SimpleNamespace(buffer=buffer, slot_bytes=64, num_slots=4)
    rows = np.arange(2 * 64, dtype=np.uint8).reshape(2, 64)
    _write_run(arena, [3, 1], rows)
    assert np.array_equal(buffer[192:256], rows[0]) and np.array_equal(buffer[64:128], rows[1])
    before = buffer.copy()
    wide = np.ones((1, 65), np.uint8)  # would run into the next slot, or past the arena
    with pytest.raises(LayoutMismatchError, match="does not fit"):
        _write_run(arena, [3], wide)
    for slots in ([4, 0], [-1, 0]):  # past the end; and one that numpy would wrap
        with pytest.raises(IndexError, match="out of range"):
            _write_run(arena, slots, rows)
    assert np.array_equal(buffer, before)  # nothing written by any of them
