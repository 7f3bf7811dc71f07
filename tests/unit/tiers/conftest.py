"""The test tiers (``specs``) registered for the tests that ask for them, and gone after; the
in-process plane of ``tests/unit/actors`` builds them as it builds the four built in."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "actors"))

from specs import CXL, HDD  # noqa: E402

from cmx.tiers import Tier, register_tier, unregister_tier  # noqa: E402


@pytest.fixture
def registered() -> Iterator[tuple[Tier, Tier]]:
    """``(cxl, hdd)``, registered: the one change a new tier makes outside its folder."""
    tiers = (register_tier(CXL), register_tier(HDD))
    yield tiers
    for tier in tiers:
        unregister_tier(tier)
