"""The calibration's prediction and its docs section, without Ray (the measurements need a
cluster; ``cmx simulate --calibrate`` runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmx.simulate.calibrate import (
    CalibrationResult,
    ControlCosts,
    MachineSpeeds,
    Row,
    predict_load,
)
from cmx.simulate.calibrate_docs import BEGIN, END, rewrite_section

MiB = 1 << 20
SPEEDS = MachineSpeeds(copy=4e9, copy_out=2e9, odirect_read=1e9, checksum=8e9, nixl=3e9,
                       nixl_note="test")
COSTS = ControlCosts(fixed_s=0.01, per_block_s=0.002)


@pytest.mark.parametrize("source, link, verified", [
    ("dram", SPEEDS.copy, False),  # arena to arena, then into the client's tensor
    ("nvme", SPEEDS.odirect_read, True),  # O_DIRECT into the arena, checksummed
    ("dram@peer", SPEEDS.nixl, True),  # NIXL into the arena, checksummed
])
def test_the_simulator_adds_up_a_loads_parts_as_the_service_takes_them(
    source: str, link: float, verified: bool,
) -> None:
    blocks, block = 16, 16 * MiB
    nbytes = blocks * block
    expected = (COSTS.fixed_s + blocks * COSTS.per_block_s + nbytes / link
                + nbytes / SPEEDS.copy_out + (nbytes / SPEEDS.checksum if verified else 0.0))
    assert predict_load(SPEEDS, COSTS, source, blocks, block) == pytest.approx(expected)


def _result(error: float) -> CalibrationResult:
    row = Row("dram", 16, 256 * MiB, (1.0, 1.1, 0.9), (1.0 + error,) * 3)
    return CalibrationResult(SPEEDS, {"dram": COSTS}, (row,), ("a note",))


def test_a_prediction_passes_within_25_percent_and_misses_beyond() -> None:
    assert _result(0.2).ok and not _result(0.3).ok and not _result(-0.3).ok
    assert _result(0.2).rows[0].error == pytest.approx(0.2)


def test_the_docs_section_is_replaced_between_its_markers_and_nothing_else(
    tmp_path: Path,
) -> None:
    page = tmp_path / "B.md"
    page.write_text("# head\n\nbefore\n")
    rewrite_section(page, _result(0.1))
    first = page.read_text()
    assert first.startswith("# head\n\nbefore\n") and first.count(BEGIN) == 1
    page.write_text(first + "\nafter\n")
    rewrite_section(page, _result(0.5))
    text = page.read_text()
    assert text.count(BEGIN) == text.count(END) == 1
    assert "**MISS**" in text and "**PASS**" not in text and text.endswith("after\n")


def test_control_costs_come_from_the_tiny_loads_less_the_slots_a_peer_moves() -> None:
    from cmx.simulate.calibrate import _control

    tiny = {1: [0.012], 8: [0.026]}
    local = _control(tiny, 0)
    assert local.per_block_s == pytest.approx(0.002) and local.fixed_s == pytest.approx(0.010)
    peer = _control(tiny, 0, slot_s=0.0015)  # each tiny block moved a whole slot
    assert peer.per_block_s == pytest.approx(0.0005) and peer.fixed_s == pytest.approx(0.010)
