"""An operator's pin (``POST /api/v1/pin``) holds its block for the TTL its request names, past
the lease every other pin has, and is given back once that TTL has passed; ``/api/v1/unpin`` of
the key ends it first. A bad TTL is refused and pins nothing. The admin app runs over the real
tiers of an in-process plane, their time a fake clock."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from plane import Plane, make_plane
from scenarios import LEASE_S, blocks, check, small_config

from cmx.actors.service import Controller
from cmx.actors.tiers.arena import DEFAULT_LEASE_S
from cmx.actors.tiers.leases import ADMIN_PIN_DEFAULT_S, ADMIN_PIN_MAX_S
from cmx.api.app import create_app
from cmx.api.backend import ServiceBackend
from cmx.client import ContextMemory
from cmx.config import AdminConfig
from cmx.doors import PinFor, ReleaseOwner, Request
from cmx.errors import UnavailableError
from cmx.tiers import Tier

# Hex ids, as the API names nodes; new ones each run, so two runs never share arena names.
NODES = tuple(sorted(secrets.token_hex(28) for _ in range(2)))
TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TTL_S = 300.0  # longer than any lease: the tiers' here and the service's default
assert TTL_S > 2 * max(LEASE_S, DEFAULT_LEASE_S)


class Nodes(Controller):
    """The controller's answer to which nodes the service runs on (and no pool), without the
    cluster it watches."""

    def __init__(self, nodes: list[str]) -> None:
        self.known = set(nodes)
        self.pool: set[str] = set()


@dataclass
class Admin:
    plane: Plane
    client: TestClient
    key: str

    def ref(self, tier: Tier, **more: Any) -> dict[str, Any]:
        return {"key": self.key, "node": NODES[0][:10], "tier": tier.value, **more}

    def evict(self, tier: Tier) -> int:
        body = {"keys": [self.key], "tier": tier.value, "node": NODES[0]}
        r = self.client.post("/api/v1/evict", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        return int(r.json()["evicted"])

    def wait(self, seconds: float) -> None:
        """Time passes; every tier takes back the leases that ran out (its heartbeat)."""
        self.plane.clock.advance(seconds)
        for tier in self.plane.tiers.values():
            tier.heartbeat()


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[Admin]:
    plane = make_plane(small_config(tmp_path, placement="write_through",
                                    nvme_admission_min_count=1), NODES)
    plane.link._targets["cmx:controller"] = Nodes(list(NODES))  # type: ignore[attr-defined]
    cm = ContextMemory(plane.config, NODES[0], owns_ray=False)
    cm.link = plane.link  # type: ignore[assignment]
    app = create_app(lambda: ServiceBackend(cm), AdminConfig(token=TOKEN),
                     sample_in_background=False)
    try:
        keys, payload = blocks(1, seed=61)
        plane.agents[NODES[0]].store(keys, [None], payload)
        for tier in (Tier.DRAM, Tier.NVME):
            assert plane.tiers[(NODES[0], tier)].contains(keys) == [True]
        with TestClient(app) as client:
            yield Admin(plane, client, keys[0].hex())
        check(plane)
    finally:
        plane.close()


@pytest.mark.parametrize("tier", [Tier.DRAM, Tier.NVME])
def test_an_operators_pin_holds_for_its_ttl_and_no_longer(admin: Admin, tier: Tier) -> None:
    r = admin.client.post("/api/v1/pin", json=admin.ref(tier, ttl_s=TTL_S), headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"key": admin.key, "node": NODES[0], "tier": tier.value, "done": True,
                        "ttl_s": TTL_S}
    admin.wait(TTL_S / 2)  # past every lease: the pin holds
    assert admin.plane.tiers[(NODES[0], tier)].stats().leases.pinned == 1
    assert admin.evict(tier) == 0
    admin.wait(TTL_S / 2 + 1)  # past its TTL: given back
    assert admin.plane.tiers[(NODES[0], tier)].stats().leases.pinned == 0
    assert admin.evict(tier) == 1


def test_an_operators_pin_without_a_ttl_holds_for_the_default(admin: Admin) -> None:
    r = admin.client.post("/api/v1/pin", json=admin.ref(Tier.DRAM), headers=AUTH)
    assert r.status_code == 200 and r.json()["ttl_s"] == ADMIN_PIN_DEFAULT_S
    admin.wait(ADMIN_PIN_DEFAULT_S - 1)
    assert admin.evict(Tier.DRAM) == 0
    admin.wait(2)
    assert admin.evict(Tier.DRAM) == 1


def test_unpinning_the_key_ends_an_operators_pin_before_its_ttl(admin: Admin) -> None:
    ref = admin.ref(Tier.DRAM)
    assert admin.client.post("/api/v1/pin", json={**ref, "ttl_s": TTL_S}, headers=AUTH).is_success
    assert admin.evict(Tier.DRAM) == 0
    r = admin.client.post("/api/v1/unpin", json=ref, headers=AUTH)
    assert r.status_code == 200 and r.json()["done"] is True
    assert admin.plane.tiers[(NODES[0], Tier.DRAM)].stats().leases.pinned == 0
    assert admin.evict(Tier.DRAM) == 1


@pytest.mark.parametrize("ttl", [0, -5, ADMIN_PIN_MAX_S + 1, "60", True, None, [60]])
def test_a_bad_ttl_is_refused_and_pins_nothing(admin: Admin, ttl: Any) -> None:
    r = admin.client.post("/api/v1/pin", json=admin.ref(Tier.DRAM, ttl_s=ttl), headers=AUTH)
    assert r.status_code == 422, r.text
    assert admin.plane.tiers[(NODES[0], Tier.DRAM)].stats().leases.pinned == 0
    assert admin.evict(Tier.DRAM) == 1


@pytest.mark.parametrize("ttl", [0.0, -1.0, ADMIN_PIN_MAX_S * 2, float("nan"), float("inf")])
def test_a_tier_refuses_a_bad_ttl_before_it_pins(admin: Admin, ttl: float) -> None:
    dram = admin.plane.tiers[(NODES[0], Tier.DRAM)]
    with pytest.raises(ValueError, match="TTL"):
        dram.pin_for([bytes.fromhex(admin.key)], ttl)
    assert dram.stats().leases.pinned == 0 and dram.stats().pinned == 0


class LateLink:
    """The plane's link, but each ``pin_for`` answers too late: it ran, and the caller got
    a timeout."""

    def __init__(self, link: Any) -> None:
        self._link = link

    def call(self, name: str, request: Request[Any], timeout_s: float | None = None) -> Any:
        answer = self._link.call(name, request)
        if isinstance(request, PinFor):
            raise UnavailableError(f"{name}.{request.method} did not answer in time")
        return answer

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._link, attr)


def test_a_pin_whose_answer_came_too_late_is_given_back(admin: Admin) -> None:
    cm = ContextMemory(admin.plane.config, NODES[0], owns_ray=False)
    cm.link = LateLink(admin.plane.link)  # type: ignore[assignment]
    dram = admin.plane.tiers[(NODES[0], Tier.DRAM)]
    with pytest.raises(UnavailableError):
        ServiceBackend(cm).pin(NODES[0], Tier.DRAM, bytes.fromhex(admin.key), TTL_S)
    assert dram.stats().leases.pinned == 0 and dram.stats().pinned == 0
    assert admin.evict(Tier.DRAM) == 1


class ReorderedLink(LateLink):
    """The plane's link, but each ``pin_for`` times out before it runs, and runs only after
    the ``release_owner`` sent behind it: the order a threaded tier actor may take."""

    def __init__(self, link: Any) -> None:
        super().__init__(link)
        self.held_back: list[tuple[str, PinFor]] = []

    def call(self, name: str, request: Request[Any], timeout_s: float | None = None) -> Any:
        if isinstance(request, PinFor):
            self.held_back.append((name, request))
            raise UnavailableError(f"{name}.{request.method} did not answer in time")
        return self._link.call(name, request)

    def tell(self, name: str, request: Request[Any]) -> None:
        self._link.tell(name, request)
        if isinstance(request, ReleaseOwner):
            for held_name, pin in [(n, p) for n, p in self.held_back if p.owner == request.owner]:
                self.held_back.remove((held_name, pin))
                self._link.call(held_name, pin)


@pytest.mark.parametrize("tier", [Tier.DRAM, Tier.NVME])
def test_a_pin_that_runs_after_its_release_is_refused(admin: Admin, tier: Tier) -> None:
    cm = ContextMemory(admin.plane.config, NODES[0], owns_ray=False)
    link = ReorderedLink(admin.plane.link)
    cm.link = link  # type: ignore[assignment]
    store = admin.plane.tiers[(NODES[0], tier)]
    with pytest.raises(UnavailableError):
        ServiceBackend(cm).pin(NODES[0], tier, bytes.fromhex(admin.key), TTL_S)
    assert not link.held_back  # the pin ran, after its release
    assert store.stats().leases.pinned == 0 and store.stats().pinned == 0
    assert admin.evict(tier) == 1
