"""The one verifier (``cmx.client.copy_out``): blocks copied on several threads land exactly,
the first that fails ends the prefix whichever thread copied it, and a closed write gate
waits out the write inside it and lets none through after."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cmx.checksum import checksum
from cmx.client import copy_out
from cmx.client.copy_out import TensorSink, copy_payloads
from cmx.connectors.paged import LoadCancelled, WriteGate
from cmx.layout import KVLayout, PayloadOrder

BOUND_S = 30.0


def blocks(layout: KVLayout, n: int, seed: int) -> tuple[torch.Tensor, list]:
    kv = layout.random_kv(n * layout.block_tokens, seed=seed)
    payloads = [p.numpy().copy() for p in layout.split_blocks(kv)]
    return kv, [(bytes([i]) * 32, p, checksum(p)) for i, p in enumerate(payloads)]


@pytest.fixture(params=[PayloadOrder.LAYER_MAJOR, PayloadOrder.HEAD_MAJOR])
def layout(request: pytest.FixtureRequest) -> KVLayout:
    # 1 MiB blocks: a load of 12 is past THREADED_BYTES, so it runs on several threads.
    return KVLayout(num_layers=4, num_kv_heads=4, head_dim=128, dtype="bfloat16",
                    block_tokens=256, order=request.param)


def test_a_load_copied_on_several_threads_is_exact(layout: KVLayout,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_out, "COPY_THREADS", 3)
    kv, payloads = blocks(layout, 12, seed=1)
    assert 12 * layout.block_bytes >= copy_out.THREADED_BYTES
    out = torch.zeros(layout.shape(12 * layout.block_tokens), dtype=kv.dtype)
    copied_on: set[str] = set()
    put = TensorSink.put

    def traced(self: TensorSink, i: int, index: tuple[slice, ...], src: np.ndarray) -> None:
        copied_on.add(threading.current_thread().name)
        put(self, i, index, src)

    monkeypatch.setattr(TensorSink, "put", traced)
    assert copy_payloads(layout, payloads, out) == 12
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
    assert len(copied_on) > 1


@pytest.mark.parametrize("bad", [0, 5, 11])
def test_the_first_corrupt_block_ends_the_prefix_whichever_thread_copied_it(
        layout: KVLayout, bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_out, "COPY_THREADS", 3)
    kv, payloads = blocks(layout, 12, seed=2)
    payloads[bad][1][-1] ^= 0xFF
    if bad < 11:
        payloads[11][1][0] ^= 0xFF  # a later one too: only the first counts
    T = layout.block_tokens
    out = torch.zeros(layout.shape(12 * T), dtype=kv.dtype)
    assert copy_payloads(layout, payloads, out) == bad
    assert torch.equal(out[:, :, :, : bad * T].view(torch.int16),
                       kv[:, :, :, : bad * T].view(torch.int16))
    assert not out[:, :, :, bad * T : (bad + 1) * T].any()  # landed, then wiped


def test_a_closed_gate_waits_for_the_write_inside_and_admits_none_after() -> None:
    gate = WriteGate()
    inside, leave, closed = threading.Event(), threading.Event(), threading.Event()

    def writer() -> None:
        with gate.enter():
            inside.set()
            assert leave.wait(BOUND_S)

    def closer() -> None:
        gate.close()
        closed.set()

    w = threading.Thread(target=writer)
    w.start()
    assert inside.wait(BOUND_S)
    c = threading.Thread(target=closer)
    c.start()
    assert not closed.wait(0.2)  # the write inside is not cut off
    leave.set()
    assert closed.wait(BOUND_S)
    with pytest.raises(LoadCancelled):
        with gate.enter():
            pass
    w.join(BOUND_S)
    c.join(BOUND_S)
