"""Selections: validation, the runs they name, and their bytes read back as tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cmx.layout import KVLayout, PayloadOrder
from cmx.selection import Selection, SelectionError, gather

LAYER = KVLayout(num_layers=4, num_kv_heads=8, head_dim=16, dtype="float16", block_tokens=8)
HEAD = KVLayout(num_layers=4, num_kv_heads=8, head_dim=16, dtype="float16", block_tokens=8,
                order=PayloadOrder.HEAD_MAJOR)


@pytest.mark.parametrize("layout", [LAYER, HEAD])
@pytest.mark.parametrize("layers, heads", [(None, 3), (range(1, 3), None), (slice(0, 2), [5, 6]),
                                           (2, slice(None)), (None, None)])
def test_gathered_bytes_read_back_as_the_slice_of_the_block(
    layout: KVLayout, layers: object, heads: object
) -> None:
    kv = layout.random_kv(layout.block_tokens, seed=4)
    payload = layout.to_payload(kv).numpy()
    sel = Selection.of(layout, layers, heads)
    data = gather(payload, sel.runs(layout))
    assert data.nbytes == sel.block_bytes(layout)
    want = kv[sel.layers.start : sel.layers.stop, :, sel.heads.start : sel.heads.stop]
    assert torch.equal(sel.to_tensor(layout, data), want)


def test_one_head_of_a_head_major_block_is_one_run_and_of_a_layer_major_one_two_per_layer(
) -> None:
    assert len(Selection.of(HEAD, None, 3).runs(HEAD)) == 1
    assert len(Selection.of(LAYER, None, 3).runs(LAYER)) == 2 * LAYER.num_layers
    assert len(Selection.of(LAYER, 1, None).runs(LAYER)) == 1


@pytest.mark.parametrize("layers, heads", [
    (4, None), (-1, None), (None, 8), (range(0, 4, 2), None), (slice(0, 4, 2), None),
    ([1, 3], None), ([], None), (True, None), ("0", None), (None, 2.0), (range(3, 3), None),
    (slice(2, 9), None),
])
def test_a_selection_outside_the_layout_raises_a_typed_error(layers: object,
                                                             heads: object) -> None:
    with pytest.raises(SelectionError):
        Selection.of(LAYER, layers, heads)  # type: ignore[arg-type]


def test_bytes_of_the_wrong_size_are_refused() -> None:
    sel = Selection.of(LAYER, 0, 0)
    with pytest.raises(SelectionError.__mro__[1]):
        sel.to_tensor(LAYER, np.zeros(sel.block_bytes(LAYER) + 2, np.uint8))
