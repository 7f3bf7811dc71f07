"""Policies: eviction, admission, placement, prefetch. Each kind behind a small registry."""

from __future__ import annotations

from cmx.policies.admission import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    AlwaysAdmit,
    FrequencyAdmission,
    make_admission,
)
from cmx.policies.eviction import EVICTION_POLICIES, EvictionPolicy, make_eviction
from cmx.policies.placement import (
    PLACEMENTS,
    Placement,
    PlacementPolicy,
    WriteBack,
    WriteThrough,
    make_placement,
)

__all__ = [
    "ADMISSION_POLICIES",
    "EVICTION_POLICIES",
    "PLACEMENTS",
    "AdmissionPolicy",
    "AlwaysAdmit",
    "EvictionPolicy",
    "FrequencyAdmission",
    "Placement",
    "PlacementPolicy",
    "WriteBack",
    "WriteThrough",
    "make_admission",
    "make_eviction",
    "make_placement",
]
