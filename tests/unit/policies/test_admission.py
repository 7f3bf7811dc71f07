"""Admission: always, and Dynamo-style "seen at least twice" with bounded memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmx.policies import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    AlwaysAdmit,
    FrequencyAdmission,
    make_admission,
)


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_always_admits_everything() -> None:
    policy = make_admission("always")
    assert isinstance(policy, AlwaysAdmit)
    assert policy.admit(key(1))
    policy.record(key(1))
    policy.check_integrity()


def test_a_block_is_admitted_on_its_second_sighting() -> None:
    policy = make_admission("frequency", capacity=1024)
    assert not policy.admit(key(1))
    policy.record(key(1))  # stored once
    assert not policy.admit(key(1))
    assert not policy.admit(key(1))  # asking does not count
    policy.record(key(1))  # looked up (or stored again)
    assert policy.admit(key(1))
    assert not policy.admit(key(2))
    policy.check_integrity()


def test_min_count_is_the_threshold() -> None:
    policy = FrequencyAdmission(min_count=3, capacity=256)
    for seen in range(1, 5):
        policy.record(key(7))
        assert policy.admit(key(7)) is (seen >= 3)
        assert policy.count(key(7)) == seen


def test_memory_stays_bounded_whatever_the_number_of_keys() -> None:
    policy = FrequencyAdmission(capacity=512, depth=4)
    size = policy._table.nbytes
    for i in range(20_000):
        policy.record(key(i))
    assert policy._table.nbytes == size == 4 * 512
    assert policy.halvings >= 3  # every 10 x capacity records the counts halve
    policy.check_integrity()


def test_old_popularity_fades() -> None:
    policy = FrequencyAdmission(capacity=64)
    policy.record(key(1))
    policy.record(key(1))
    assert policy.admit(key(1))
    for _ in range(640 - 2):  # the rest of one halving window: another, popular key
        policy.record(key(2))
    assert policy.halvings == 1
    assert policy.count(key(1)) == 1 and not policy.admit(key(1))
    assert policy.admit(key(2))


def test_counters_saturate_instead_of_wrapping() -> None:
    policy = FrequencyAdmission(capacity=4096)
    for _ in range(300):
        policy.record(key(1))
    assert policy.count(key(1)) == 255 and policy.admit(key(1))


def test_the_registry_and_its_errors() -> None:
    assert set(ADMISSION_POLICIES) == {"always", "frequency"}
    mine = AlwaysAdmit()
    assert make_admission(mine) is mine
    assert make_admission("frequency", min_count=5).min_count == 5  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_admission("lfu")
    for bad in ({"min_count": 0}, {"min_count": 256}, {"capacity": 0}, {"depth": 9},
                {"capacity": 1.5}):
        with pytest.raises(ValueError):
            FrequencyAdmission(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        AdmissionPolicy()  # type: ignore[abstract]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200))
def test_a_sketch_never_undercounts(seen: list[int]) -> None:
    """Without a halving, the estimate is at least the true count (and exact when sparse)."""
    policy = FrequencyAdmission(capacity=1 << 12)
    for i in seen:
        policy.record(key(i))
    for i in set(seen):
        assert policy.count(key(i)) >= seen.count(i)
        assert policy.admit(key(i)) is (policy.count(key(i)) >= 2)
    policy.check_integrity()


def test_a_sketch_sent_to_another_process_keeps_its_counts() -> None:
    import pickle

    from cmx.policies.admission import FrequencyAdmission

    sketch = FrequencyAdmission(min_count=2, capacity=64)
    sketch.record(b"a")
    copy = pickle.loads(pickle.dumps(sketch))
    assert copy.count(b"a") == 1 and not copy.admit(b"a")
    copy.record(b"a")  # the copy counts on in its own table
    assert copy.admit(b"a") and not sketch.admit(b"a")
