"""Private by default: what is cached is told only to the token's holder, and no figure the API
shows is one tenant's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pytest
from api_fakes import NODE_A, TOKEN, FakeBackend, admin
from fastapi.testclient import TestClient

from cmx.api.app import create_app
from cmx.config import AdminConfig
from cmx.keys import Namespace, chain_keys
from cmx.layout import KVLayout
from cmx.stats import ServiceStats, TierStats
from cmx.storage.base import StoreStats
from cmx.tiers import Tier

AUTH = {"Authorization": f"Bearer {TOKEN}"}
LAYOUT: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16",
          "block_tokens": 16}
SALT = "tenant-a-secret-salt"
TOKENS = list(range(32))
LOOKUP = {"model": "m", "layout": LAYOUT, "salt": SALT, "token_ids": TOKENS}


@contextmanager
def client_for(backend: FakeBackend, **config: Any) -> Iterator[TestClient]:
    app = create_app(lambda: backend, admin(**config), sample_in_background=False)
    with TestClient(app) as c:
        yield c


@pytest.fixture
def backend() -> FakeBackend:
    """Tenant A's first block is cached in DRAM."""
    b = FakeBackend()
    b.put(cached_key(), NODE_A, Tier.DRAM)
    return b


def cached_key() -> bytes:
    return chain_keys(Namespace("m", KVLayout(**LAYOUT), SALT).digest, TOKENS, 16)[0]


def queries(c: TestClient, headers: dict[str, str] | None = None) -> list[Any]:
    return [c.post("/api/v1/lookup", json=LOOKUP, headers=headers),
            c.get(f"/api/v1/blocks/{cached_key().hex()}", headers=headers)]


def test_lookups_and_block_queries_need_the_token_by_default(backend: FakeBackend) -> None:
    with client_for(backend) as c:
        for r in queries(c):
            assert r.status_code == 401, r.text
            assert r.headers["content-type"] == "application/problem+json"
            assert set(r.json()) == {"type", "title", "status", "detail", "instance"}
        for r in queries(c, {"Authorization": "Bearer not-the-token-at-all"}):
            assert r.status_code == 401
        lookup, block = queries(c, AUTH)
        assert lookup.json()["num_blocks"] == 1
        assert block.json()["copies"][0]["tier"] == "dram"
        # Figures summed over tenants stay open to read, as before.
        assert c.get("/api/v1/tiers").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_a_server_without_a_token_refuses_queries(backend: FakeBackend) -> None:
    with client_for(backend, token=None) as c:
        assert [r.status_code for r in queries(c, AUTH)] == [403, 403]


def test_open_queries_opens_them_and_token_all_still_wins(backend: FakeBackend) -> None:
    with client_for(backend, open_queries=True) as c:
        assert [r.status_code for r in queries(c)] == [200, 200]
    with client_for(backend, open_queries=True, token_all=True) as c:
        assert [r.status_code for r in queries(c)] == [401, 401]


def test_open_queries_is_a_documented_setting() -> None:
    assert AdminConfig().open_queries is False
    assert AdminConfig.from_env({"CMX_ADMIN_OPEN_QUERIES": "1"}).open_queries is True
    schema = create_app(FakeBackend, admin()).openapi()
    assert "CMX_ADMIN_OPEN_QUERIES" in schema["paths"]["/api/v1/lookup"]["post"]["description"]


def test_no_answer_carries_a_salt(backend: FakeBackend) -> None:
    with client_for(backend, token_all=True) as c:
        answers = queries(c, AUTH)
        answers += [c.post("/api/v1/lookup", json={**LOOKUP, "bogus": SALT}, headers=AUTH),
                    c.post("/api/v1/lookup", json={**LOOKUP, "token_ids": [-1]}, headers=AUTH),
                    c.post("/api/v1/lookup", json={**LOOKUP, "salt": SALT * 40},
                           headers=AUTH)]
        for path, ops in c.app.openapi()["paths"].items():  # type: ignore[attr-defined]
            if "get" in ops and "{" not in path:
                answers.append(c.get(path, headers=AUTH))
    assert [r.status_code for r in answers[:5]] == [200, 200, 422, 422, 422]
    assert len(answers) > 10
    for r in answers:
        assert SALT not in r.text, (r.request.url, r.text)


@dataclass
class TenantFigures(StoreStats):
    """A store's own figures kept per tenant: none of them may be shown."""

    namespace_hits: int = 0
    tenant: str = ""
    hits_by_tenant: dict[str, int] = field(default_factory=dict)


def test_figures_a_part_reports_per_tenant_are_never_shown(backend: FakeBackend) -> None:
    ns_id = Namespace("m", KVLayout(**LAYOUT), SALT).id
    raw_stats = backend.stats

    def stats_with_tenant_figures() -> ServiceStats:
        stats = raw_stats()
        node = stats.nodes[NODE_A]
        dram = node.tiers[Tier.DRAM]
        assert isinstance(dram, TierStats)
        store = TenantFigures(**asdict(dram.store), namespace_hits=7, tenant=SALT,
                              hits_by_tenant={ns_id: 7})
        tiers = {**node.tiers, Tier.DRAM: replace(dram, store=store)}
        return replace(stats, nodes={**stats.nodes, NODE_A: replace(node, tiers=tiers)})

    backend.stats = stats_with_tenant_figures  # type: ignore[method-assign]
    with client_for(backend) as c:
        texts = [c.get(p).text for p in ("/api/v1/tiers", "/api/v1/pool", "/metrics",
                                          f"/api/v1/nodes/{NODE_A}", "/api/v1/history")]
        pool = c.get("/api/v1/pool").json()
        dram = next(t for t in c.get(f"/api/v1/nodes/{NODE_A}").json()["tiers"]
                    if t["tier"] == "dram")
    assert set(pool["detail"]) <= {"under_replicated"}
    assert not {"namespace_hits", "tenant", "hits_by_tenant"} & dram["extra"].keys()
    for text in texts:
        assert ns_id not in text and SALT not in text
