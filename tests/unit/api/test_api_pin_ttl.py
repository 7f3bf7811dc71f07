"""The TTL of an operator's pin at the API's edge: named in the request (a number of seconds,
more than 0 and at most a day; an hour if unnamed), shown in the answer; anything else is a 422
that pins nothing. That the tiers hold the pin that long and no longer is
``tests/unit/actors/test_admin_pins.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from api_fakes import NODE_A, TOKEN, FakeBackend, admin
from fastapi.testclient import TestClient

from cmx.actors.tiers.leases import ADMIN_PIN_DEFAULT_S, ADMIN_PIN_MAX_S
from cmx.api.app import create_app
from cmx.tiers import Tier

AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEY = bytes(range(32))
REF = {"key": KEY.hex(), "node": NODE_A[:10], "tier": "dram"}


@pytest.fixture
def backend() -> FakeBackend:
    backend = FakeBackend()
    backend.put(KEY, NODE_A, Tier.DRAM)
    return backend


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    app = create_app(lambda: backend, admin(), sample_in_background=False)
    with TestClient(app) as c:
        yield c


def pins(backend: FakeBackend) -> int:
    return backend.tiers[(NODE_A, Tier.DRAM)].blocks[KEY]


@pytest.mark.parametrize(("ttl", "shown"), [
    (None, ADMIN_PIN_DEFAULT_S), (1, 1.0), (0.5, 0.5), (ADMIN_PIN_MAX_S, ADMIN_PIN_MAX_S),
])
def test_a_pin_answers_the_ttl_it_holds_for(
    client: TestClient, backend: FakeBackend, ttl: float | None, shown: float
) -> None:
    body = REF if ttl is None else {**REF, "ttl_s": ttl}
    r = client.post("/api/v1/pin", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"key": KEY.hex(), "node": NODE_A, "tier": "dram", "done": True,
                        "ttl_s": shown}
    assert pins(backend) == 1


@pytest.mark.parametrize("ttl", [
    0, 0.0, -1, ADMIN_PIN_MAX_S + 0.001, 1e308, "60", "", True, False, None, [60], {"s": 60},
])
def test_a_bad_ttl_is_422_and_pins_nothing(
    client: TestClient, backend: FakeBackend, ttl: Any
) -> None:
    r = client.post("/api/v1/pin", json={**REF, "ttl_s": ttl}, headers=AUTH)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert any(e["loc"][-1] == "ttl_s" for e in r.json()["errors"])
    assert pins(backend) == 0


def test_a_ttl_that_is_not_a_finite_number_is_422_and_pins_nothing(
    client: TestClient, backend: FakeBackend
) -> None:
    for raw in ("NaN", "Infinity", "-Infinity"):
        body = json.dumps(REF)[:-1] + f', "ttl_s": {raw}}}'
        r = client.post("/api/v1/pin", content=body, headers={
            **AUTH, "Content-Type": "application/json"})
        assert r.status_code == 422, r.text
    assert pins(backend) == 0


def test_an_unpin_takes_no_ttl(client: TestClient, backend: FakeBackend) -> None:
    assert client.post("/api/v1/pin", json=REF, headers=AUTH).status_code == 200
    r = client.post("/api/v1/unpin", json={**REF, "ttl_s": 60}, headers=AUTH)
    assert r.status_code == 422, r.text
    assert pins(backend) == 1
