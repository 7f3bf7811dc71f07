"""Small blocks copied a run at a time (``cmx.client.copy_out``, ``Sink.put_run``): exact bytes
in a KV tensor and in an engine's paged cache (every paged layout), a corrupt block in the
middle of a run ends the prefix with none of its bytes written, and a block that is not a
whole payload still goes block by block. A prefix lying in an arena's slots (``SlotRows``) is
gathered a run at a time from its slots, with the same checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cmx.checksum import checksum
from cmx.client import copy_out
from cmx.client.copy_out import TensorSink, copy_payloads
from cmx.connectors.paged import PagedLayout, PagedSink, WriteGate, block_view
from cmx.layout import KVLayout

# 8 KiB blocks: 64 to a piece, so a load of 1,100 runs in runs of 64, on several threads.
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
N = 1_100


def items(n: int, seed: int) -> tuple[torch.Tensor, list]:
    kv = SMALL.random_kv(n * SMALL.block_tokens, seed=seed)
    payloads = [p.numpy().copy() for p in SMALL.split_blocks(kv)]
    return kv, [(i.to_bytes(4, "little") * 8, p, checksum(p)) for i, p in enumerate(payloads)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def counted(monkeypatch: pytest.MonkeyPatch, cls: type) -> dict[str, int]:
    """How often ``cls.put`` (a piece of a block) and ``cls.put_run`` (a run) are called."""
    calls = {"put": 0, "put_run": 0}
    for name in calls:
        original = getattr(cls, name)

        def traced(self: object, *args: object, _name: str = name,
                   _original: object = original) -> None:
            calls[_name] += 1
            _original(self, *args)  # type: ignore[operator]
        monkeypatch.setattr(cls, name, traced)
    return calls


def test_small_blocks_land_exactly_a_run_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_out, "COPY_THREADS", 2)
    assert N * SMALL.block_bytes >= copy_out.THREADED_BYTES
    kv, payloads = items(N, seed=1)
    calls = counted(monkeypatch, TensorSink)
    T = SMALL.block_tokens
    out = torch.zeros(SMALL.shape((N + 3) * T), dtype=kv.dtype)
    assert copy_payloads(SMALL, payloads, out, first=3) == N
    assert torch.equal(bits(out[:, :, :, 3 * T :]), bits(kv))
    assert not out[:, :, :, : 3 * T].any()
    assert calls["put"] == 0  # no block went alone
    assert calls["put_run"] <= 2 * (N // 64 + 1)


@pytest.mark.parametrize("bad", [0, 70, N - 1])
def test_a_corrupt_block_in_a_run_ends_the_prefix_and_none_of_its_bytes_land(
        bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_out, "COPY_THREADS", 2)
    kv, payloads = items(N, seed=2)
    payloads[bad][1][5] ^= 0xFF
    T = SMALL.block_tokens
    out = torch.zeros(SMALL.shape(N * T), dtype=kv.dtype)
    assert copy_payloads(SMALL, payloads, out) == bad
    assert torch.equal(bits(out[:, :, :, : bad * T]), bits(kv[:, :, :, : bad * T]))
    assert not out[:, :, :, bad * T : (bad + 1) * T].any()
    base, stop = (0, N // 2) if bad < N // 2 else (N // 2, N)  # each thread's share
    run_end = min(stop, base + ((bad - base) // 64 + 1) * 64)
    # the rest of its run was not written either: the run stops at the failure
    assert not out[:, :, :, (bad + 1) * T : run_end * T].any()


def paged_caches(layout: PagedLayout, blocks: int) -> list[torch.Tensor]:
    L, H, T, D = SMALL.num_layers, SMALL.num_kv_heads, SMALL.block_tokens, SMALL.head_dim
    shape = (2, blocks, T, H, D) if layout is PagedLayout.FLASH else (blocks, H, T, 2 * D)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(L)]


def paged_blocks(caches: list[torch.Tensor], layout: PagedLayout, ids: list[int]) -> torch.Tensor:
    """[layers, 2, kv_heads, len(ids) * T, head_dim] of those paged blocks, in order."""
    H, T, D = SMALL.num_kv_heads, SMALL.block_tokens, SMALL.head_dim
    views = [block_view(c, layout, D)[ids] for c in caches]
    return torch.stack([v.permute(2, 1, 0, 3, 4).reshape(2, H, len(ids) * T, D)
                        for v in views])


@pytest.mark.parametrize("layout", list(PagedLayout))
def test_small_blocks_land_at_their_block_ids_in_every_paged_layout(
        layout: PagedLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_out, "COPY_THREADS", 2)
    kv, payloads = items(N, seed=3)
    ids = np.random.default_rng(3).permutation(2 * N)[:N].tolist()
    caches = paged_caches(layout, 2 * N)
    calls = counted(monkeypatch, PagedSink)
    sink = PagedSink(caches, layout, SMALL.head_dim, ids, WriteGate())
    assert copy_payloads(SMALL, payloads, sink) == N
    assert torch.equal(bits(paged_blocks(caches, layout, ids)), bits(kv))
    others = sorted(set(range(2 * N)) - set(ids))
    assert not paged_blocks(caches, layout, others).any()
    assert calls["put"] == 0 and calls["put_run"] > 0


def test_a_payload_that_is_not_a_whole_block_goes_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kv, payloads = items(8, seed=4)
    key, p, want = payloads[3]
    payloads[3] = (key, p.view(np.int16), want)  # the same bytes, not seen as bytes
    calls = counted(monkeypatch, TensorSink)
    out = torch.zeros(SMALL.shape(8 * SMALL.block_tokens), dtype=kv.dtype)
    assert copy_payloads(SMALL, payloads, out) == 8
    assert torch.equal(bits(out), bits(kv))
    assert calls["put"] > 0 and calls["put_run"] > 0


def in_slots(payloads: list, extra: int = 4096, seed: int = 0) -> copy_out.SlotRows:
    """``payloads`` laid in shuffled slots of an arena-like buffer, slots wider than blocks."""
    width = SMALL.block_bytes + extra
    slots = np.random.default_rng(seed).permutation(len(payloads) + 5)[: len(payloads)]
    buffer = np.full((len(payloads) + 5) * width, 0xAB, np.uint8)
    for slot, (_, p, _) in zip(slots.tolist(), payloads):
        buffer[slot * width : slot * width + len(p)] = p
    return copy_out.SlotRows([k for k, _, _ in payloads], buffer, width, slots.astype(np.int64),
                             SMALL.block_bytes, np.array([c for _, _, c in payloads], np.uint64))


def test_a_prefix_in_its_slots_is_gathered_a_run_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_out, "COPY_THREADS", 2)
    kv, payloads = items(N, seed=3)
    rows = in_slots(payloads)
    calls = counted(monkeypatch, TensorSink)
    T = SMALL.block_tokens
    out = torch.zeros(SMALL.shape(N * T), dtype=kv.dtype)
    assert copy_payloads(SMALL, rows, out) == N
    assert torch.equal(bits(out), bits(kv))
    assert calls["put"] == 0 and calls["put_run"] <= 2 * (N // 64 + 1)
    key, payload, want = rows[7]  # one asked by index: its bytes in place
    assert key == payloads[7][0] and want == payloads[7][2]
    assert np.array_equal(payload, payloads[7][1])


@pytest.mark.parametrize("bad", [0, 70, N - 1])
def test_a_corrupt_slot_ends_the_prefix_and_none_of_its_bytes_land(
        bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copy_out, "COPY_THREADS", 2)
    kv, payloads = items(N, seed=4)
    payloads[bad][1][9] ^= 0x40  # the slot's bytes differ from the checksum it was pinned with
    rows = in_slots(payloads, seed=bad)
    T = SMALL.block_tokens
    out = torch.zeros(SMALL.shape(N * T), dtype=kv.dtype)
    assert copy_payloads(SMALL, rows, out) == bad
    assert torch.equal(bits(out[:, :, :, : bad * T]), bits(kv[:, :, :, : bad * T]))
    base, stop = (0, N // 2) if bad < N // 2 else (N // 2, N)  # each thread's share
    run_end = min(stop, base + ((bad - base) // 64 + 1) * 64)
    assert not out[:, :, :, bad * T : run_end * T].any()  # nothing of its run from it on


def test_a_checksum_no_block_can_have_fails_the_block_quietly() -> None:
    kv, payloads = items(4, seed=6)
    payloads[2] = (payloads[2][0], payloads[2][1], -1)  # no XXH3-64 is negative
    out = torch.zeros(SMALL.shape(4 * SMALL.block_tokens), dtype=kv.dtype)
    assert copy_payloads(SMALL, payloads, out) == 2


def test_slots_a_tier_did_not_hold_are_refused() -> None:
    _, payloads = items(4, seed=5)
    rows = in_slots(payloads)
    with pytest.raises(IndexError, match="out of range"):
        copy_out.SlotRows(rows.keys, np.zeros(3 * 8192, np.uint8), 8192,
                          np.array([0, 3], np.int64), 8192, rows.checksums[:2])
    with pytest.raises(ValueError, match="in a slot of"):
        copy_out.SlotRows(rows.keys, np.zeros(3 * 8192, np.uint8), 8192,
                          np.array([0, 1], np.int64), 9000, rows.checksums[:2])
