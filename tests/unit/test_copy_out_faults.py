"""Faults at the edges of the one verifier (``cmx.client.copy_out``) and the caller's buffer
(``NamespaceClient.load_into``)."""

from __future__ import annotations

import pytest
import torch

from cmx.checksum import checksum
from cmx.client import copy_out
from cmx.client.copy_out import copy_payloads
from cmx.client.namespaces import NamespaceClient
from cmx.errors import LayoutMismatchError
from cmx.keys import Namespace
from cmx.layout import KVLayout

# 1 MiB blocks: a load of 12 is past THREADED_BYTES, so it runs on several threads.
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, dtype="bfloat16", block_tokens=256)
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)


def test_every_block_that_failed_its_check_leaves_none_of_its_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's promise: "A block whose checksum fails is not used: its place is zeroed
    (its bytes landed before the check could fail)". Two runs on two threads each meet a
    corrupt block: only the first is cleared; the other's corrupt bytes stay in the caller's
    tensor (or the engine's paged cache), past the prefix the count gives."""
    monkeypatch.setattr(copy_out, "COPY_THREADS", 2)
    kv = BIG.random_kv(12 * BIG.block_tokens, seed=5)
    payloads = [p.numpy().copy() for p in BIG.split_blocks(kv)]
    items = [(bytes([i]) * 32, p, checksum(p)) for i, p in enumerate(payloads)]
    for bad in (2, 9):  # one in the caller's run [0, 6), one in the pool's run [6, 12)
        items[bad][1][100] ^= 0xFF
    T = BIG.block_tokens
    out = torch.zeros(BIG.shape(12 * T), dtype=kv.dtype)
    assert copy_payloads(BIG, items, out) == 2  # the count is right
    assert not out[:, :, :, 2 * T : 3 * T].any()  # the first bad block: cleared
    assert not out[:, :, :, 9 * T : 10 * T].any(), \
        "block 9 failed its check but its corrupt bytes stay where it was copied"


def test_a_buffer_with_a_strided_head_dim_is_refused_as_a_layout_mismatch() -> None:
    """``load_into`` takes "the caller's CPU tensor ... (any strides)" and promises
    LayoutMismatchError for what it cannot take; a tensor whose head_dim is not its innermost
    dimension passes ``check_kv`` and then fails in ``kv_bytes`` with a bare RuntimeError."""
    ns = NamespaceClient(None, Namespace("m", SMALL))  # nothing reaches the service before
    T = SMALL.block_tokens
    base = torch.zeros(SMALL.num_layers, 2, SMALL.num_kv_heads, SMALL.head_dim, 2 * T,
                       dtype=torch.float16)
    out = base.transpose(3, 4)  # [layers, 2, kv_heads, tokens, head_dim], head_dim strided
    try:
        ns.load_into(list(range(2 * T)), out)
    except LayoutMismatchError:
        pass  # refused as documented
    except RuntimeError as exc:
        pytest.fail(f"load_into raised {type(exc).__name__}, not LayoutMismatchError: {exc}")
