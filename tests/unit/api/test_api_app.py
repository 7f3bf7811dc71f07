"""The admin API over an in-memory service: views, problems, tokens, admin actions."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, get_args

import pytest
from api_fakes import BLOCK, NODE_A, NODE_B, TOKEN, FakeBackend, FakeTier, admin
from fastapi.testclient import TestClient

from cmx.api.app import create_app
from cmx.api.models import Dtype
from cmx.keys import Namespace, chain_keys
from cmx.layout import DTYPE_BYTES, KVLayout
from cmx.stats import PoolStats, TierStats, Unreachable
from cmx.tiers import Tier

AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEY = bytes(range(32))
LAYOUT: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16",
          "block_tokens": 16}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@contextmanager
def client_for(backend: FakeBackend, **config: Any) -> Iterator[TestClient]:
    app = create_app(lambda: backend, admin(**config), sample_in_background=False)
    with TestClient(app) as c:
        yield c


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[TestClient]:
    with client_for(backend) as c:
        yield c


def assert_problem(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["status"] == status and body["title"] and body["type"] == "about:blank"
    return body


# -- reads -------------------------------------------------------------------------------------


def test_tiers_show_every_tier_of_every_node_with_agent_and_directory(
    client: TestClient, backend: FakeBackend
) -> None:
    backend.put(KEY, NODE_A, Tier.DRAM)
    view = client.get("/api/v1/tiers").json()
    assert [n["node"] for n in view["nodes"]] == sorted([NODE_A, NODE_B])
    a = view["nodes"][0]
    assert [t["tier"] for t in a["tiers"]] == ["hbm", "dram", "nvme"]
    hbm, dram, nvme = a["tiers"]
    assert hbm["emulated"] is True and dram["emulated"] is False
    assert dram["used_bytes"] == BLOCK and dram["blocks"] == 1
    assert dram["occupancy"] == pytest.approx(1 / 16)
    assert nvme["extra"]["io_engine"] == "pwritev"
    assert a["agent"]["transport"] == "nixl-ucx" and a["agent"]["dpu"] is False
    assert a["agent"]["queues"] == {"load": 1, "prefetch": 0, "demote": 2,
                                    "staging_bytes_in_use": 0, "staging_bytes": 1 << 20}
    assert [s["available"] for s in view["directory"]] == [True, False]


def test_bandwidth_comes_from_two_samples_and_a_restart_has_none(backend: FakeBackend) -> None:
    now = [100.0]
    with client_for(backend, sample_s=10.0) as client:
        state = client.app.state.cmx  # type: ignore[attr-defined]
        state.sampler._clock = lambda: now[0]
        state.sampler.sample()
        dram = backend.tiers[(NODE_A, Tier.DRAM)]
        dram.bytes_in += 4 * BLOCK
        dram.hits, dram.misses = 3, 1
        now[0] = 102.0
        state.sampler.sample()
        now[0] = 104.0  # the sample at 102 is young enough to answer
        view = client.get("/api/v1/tiers").json()
        assert view["nodes"][0]["tiers"][1]["bandwidth"] == {
            "in_bytes_per_s": 2 * BLOCK, "out_bytes_per_s": 0.0, "window_s": 2.0}
        dram.epoch = "e2"
        state.sampler.sample()
        got = client.get("/api/v1/tiers").json()["nodes"][0]["tiers"][1]
        assert got["bandwidth"]["in_bytes_per_s"] is None
        hist = client.get("/api/v1/history", params={"window_s": 60}).json()
        series = next(s for s in hist["series"] if s["node"] == NODE_A and s["tier"] == "dram")
        assert [p["hit_ratio"] for p in series["points"]] == [None, 0.75, None]


def test_a_tier_that_does_not_answer_is_shown_not_failed(
    client: TestClient, backend: FakeBackend
) -> None:
    backend.tiers[(NODE_B, Tier.NVME)].down = True
    view = client.get("/api/v1/tiers").json()
    nvme = view["nodes"][1]["tiers"][2]
    assert nvme["available"] is False and "did not answer" in nvme["error"]
    nodes = client.get("/api/v1/nodes").json()["nodes"]
    assert nodes[1]["tiers"] == ["hbm", "dram"] and nodes[1]["placement"] == "host"


def test_node_by_prefix_and_unknown_node(client: TestClient) -> None:
    assert client.get(f"/api/v1/nodes/{NODE_B[:8]}").json()["node"] == NODE_B
    assert_problem(client.get("/api/v1/nodes/cccccccc"), 404)
    assert_problem(client.get("/api/v1/nodes/not-hex!"), 422)


def test_block_copies_by_hex_key(client: TestClient, backend: FakeBackend) -> None:
    backend.put(KEY, NODE_A, Tier.DRAM)
    backend.put(KEY, NODE_B, Tier.NVME)
    body = client.get(f"/api/v1/blocks/{KEY.hex().upper()}", headers=AUTH).json()
    assert body["key"] == KEY.hex()
    assert {(c["tier"], c["node"]) for c in body["copies"]} == {("dram", NODE_A),
                                                                 ("nvme", NODE_B)}
    assert_problem(client.get(f"/api/v1/blocks/{'00' * 32}", headers=AUTH), 404)
    bad = assert_problem(client.get("/api/v1/blocks/xyz", headers=AUTH), 422)
    assert bad["errors"][0]["loc"] == ["path", "key"]
    assert_problem(client.get(f"/api/v1/blocks/{KEY.hex()}00", headers=AUTH), 422)


def test_lookup_finds_the_longest_prefix_and_its_fastest_copies(
    client: TestClient, backend: FakeBackend
) -> None:
    tokens = list(range(16 * 3 + 5))
    ns = Namespace("m", KVLayout(**LAYOUT), "salt")
    keys = chain_keys(ns.digest, tokens, 16)
    backend.put(keys[0], NODE_A, Tier.NVME)
    backend.put(keys[0], NODE_B, Tier.DRAM)
    backend.put(keys[1], NODE_A, Tier.HBM)
    backend.put(keys[2], NODE_A, Tier.DRAM)
    body = {"model": "m", "layout": LAYOUT, "salt": "salt", "token_ids": tokens}
    r = client.post("/api/v1/lookup", json=body, headers=AUTH).json()
    assert r["namespace_id"] == ns.id and r["full_blocks"] == 3
    assert r["num_blocks"] == 3 and r["num_tokens"] == 48
    assert (r["blocks"][0]["tier"], r["blocks"][0]["node"]) == ("dram", NODE_B)
    assert r["blocks"][1]["tier"] == "hbm"
    backend.tiers[(NODE_A, Tier.HBM)].blocks.clear()
    r = client.post("/api/v1/lookup", json=body, headers=AUTH).json()
    assert r["num_blocks"] == 1  # a prefix stops at its first miss
    other = client.post("/api/v1/lookup", json={**body, "salt": "other"}, headers=AUTH).json()
    assert other["num_blocks"] == 0 and other["namespace_id"] != ns.id


@pytest.mark.parametrize("change", [
    {"token_ids": [-1]}, {"token_ids": [2**32]}, {"token_ids": "1 2 3"},
    {"layout": {**LAYOUT, "dtype": "int7"}}, {"layout": {**LAYOUT, "num_layers": 0}},
    {"model": ""}, {"unexpected": 1},
])
def test_lookup_rejects_bad_input_with_422(client: TestClient, change: dict[str, Any]) -> None:
    body = {"model": "m", "layout": LAYOUT, "token_ids": [1, 2], **change}
    assert_problem(client.post("/api/v1/lookup", json=body, headers=AUTH), 422)


def test_the_api_knows_every_dtype_of_the_layouts() -> None:
    assert set(get_args(Dtype)) == set(DTYPE_BYTES)


def test_malformed_json_and_oversized_bodies_are_4xx(client: TestClient) -> None:
    r = client.post("/api/v1/lookup", content=b"{not json",
                    headers={"content-type": "application/json", **AUTH})
    assert_problem(r, 422)
    r = client.post("/api/v1/lookup", content=b"[]",
                    headers={"content-type": "application/json", "content-length": str(1 << 30)})
    assert_problem(r, 413)


def test_pool_is_empty_without_one_and_shown_with_one(
    client: TestClient, backend: FakeBackend
) -> None:
    assert client.get("/api/v1/pool").json()["enabled"] is False
    member = FakeTier(Tier.POOL, "p1")
    member.blocks = {b"k1": 0, b"k2": 0}
    member_stats = member.stats()
    assert isinstance(member_stats, TierStats)
    backend.pool = PoolStats({"p1": member_stats, "p2": Unreachable("p2 did not answer")},
                             2, 2, 1)
    client.app.state.cmx.sampler.sample()  # type: ignore[attr-defined]
    pool = client.get("/api/v1/pool").json()
    assert pool["enabled"] is True and pool["replication"] == 2
    assert pool["capacity_bytes"] == member_stats.capacity_bytes
    assert [(n["node"], n["used_bytes"], n["available"]) for n in pool["nodes"]] == [
        ("p1", 2 * BLOCK, True), ("p2", 0, False)]
    assert pool["detail"] == {"under_replicated": 1}


def test_health_readiness_openapi_and_unknown_routes(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").json() == {"ready": True, "nodes": 2, "detail": None}
    schema = client.get("/openapi.json").json()
    assert "/api/v1/evict" in schema["paths"]
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert_problem(client.get("/api/v1/nothing"), 404)
    assert_problem(client.put("/api/v1/tiers"), 405)


def test_readiness_is_503_when_the_service_cannot_be_reached() -> None:
    def unreachable() -> FakeBackend:
        raise ConnectionError("no cluster")

    app = create_app(unreachable, admin(), sample_in_background=False)
    with TestClient(app) as c:
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False
        assert_problem(c.get("/api/v1/tiers"), 503)
        assert c.get("/healthz").status_code == 200


# -- tokens ------------------------------------------------------------------------------------


def test_mutations_need_the_token(client: TestClient) -> None:
    body = {"keys": [KEY.hex()]}
    r = client.post("/api/v1/evict", json=body)
    assert_problem(r, 401)
    assert r.headers["www-authenticate"].startswith("Bearer")
    wrong = client.post("/api/v1/evict", json=body, headers={"Authorization": "Bearer nope"})
    assert_problem(wrong, 401)
    assert client.post("/api/v1/evict", json=body, headers=AUTH).status_code == 200
    assert client.get("/api/v1/tiers").status_code == 200  # reads stay open


def test_without_a_configured_token_every_mutation_is_refused(backend: FakeBackend) -> None:
    with client_for(backend, token=None) as c:
        assert_problem(c.post("/api/v1/evict", json={"keys": [KEY.hex()]}, headers=AUTH), 403)
        assert_problem(c.delete(f"/api/v1/namespaces/{'ab' * 8}"), 403)
        assert c.get("/api/v1/tiers").status_code == 200


def test_token_all_guards_reads_but_not_the_page_shell(backend: FakeBackend) -> None:
    with client_for(backend, token_all=True) as c:
        for path in ("/api/v1/tiers", "/metrics", "/healthz", "/api/v1/pool"):
            assert_problem(c.get(path), 401)
            assert c.get(path, headers=AUTH).status_code == 200
        assert c.get("/").status_code == 200
        assert c.get("/static/dashboard.js").status_code == 200


# -- admin actions -----------------------------------------------------------------------------


def test_pin_keeps_a_block_from_eviction_until_unpinned(
    client: TestClient, backend: FakeBackend
) -> None:
    backend.put(KEY, NODE_A, Tier.DRAM)
    ref = {"key": KEY.hex(), "node": NODE_A[:10], "tier": "dram"}
    r = client.post("/api/v1/pin", json=ref, headers=AUTH)
    assert r.json() == {"key": KEY.hex(), "node": NODE_A, "tier": "dram", "done": True,
                        "ttl_s": 3600.0}
    evict = {"keys": [KEY.hex()], "tier": "dram"}
    assert client.post("/api/v1/evict", json=evict, headers=AUTH).json()["evicted"] == 0
    assert client.post("/api/v1/unpin", json=ref, headers=AUTH).json()["done"] is True
    r = client.post("/api/v1/evict", json=evict, headers=AUTH).json()
    assert r["evicted"] == 1 and r["requested"] == 1
    assert {(x["node"], x["tier"]) for x in r["results"]} == {(NODE_A, "dram"), (NODE_B, "dram")}
    assert_problem(client.post("/api/v1/pin", json=ref, headers=AUTH), 404)
    assert_problem(client.post("/api/v1/unpin", json=ref, headers=AUTH), 404)


@pytest.mark.parametrize("ref", [
    {"key": "zz", "node": NODE_A, "tier": "dram"},
    {"key": KEY.hex(), "node": NODE_A, "tier": "pool"},
    {"key": KEY.hex(), "node": NODE_A, "tier": "tape"},
    {"key": KEY.hex(), "node": "", "tier": "dram"},
    {"key": KEY.hex(), "tier": "dram"},
])
def test_pin_rejects_bad_references(client: TestClient, ref: dict[str, Any]) -> None:
    assert_problem(client.post("/api/v1/pin", json=ref, headers=AUTH), 422)


def test_pin_on_an_unknown_node_is_404(client: TestClient) -> None:
    ref = {"key": KEY.hex(), "node": "cccccccc", "tier": "dram"}
    assert_problem(client.post("/api/v1/pin", json=ref, headers=AUTH), 404)


def test_evict_reports_tiers_that_did_not_answer(
    client: TestClient, backend: FakeBackend
) -> None:
    backend.put(KEY, NODE_A, Tier.NVME)
    backend.tiers[(NODE_B, Tier.NVME)].down = True
    r = client.post("/api/v1/evict", json={"keys": [KEY.hex(), KEY.hex().upper()]},
                    headers=AUTH).json()
    assert r["requested"] == 1 and r["evicted"] == 1
    assert r["unavailable"] == [f"cmx:nvme:{NODE_B}"]
    assert len(r["results"]) == 5
    too_many = {"keys": [KEY.hex()] * 1025}
    assert_problem(client.post("/api/v1/evict", json=too_many, headers=AUTH), 422)
    assert_problem(client.post("/api/v1/evict", json={"keys": []}, headers=AUTH), 422)


def test_drop_namespace_is_501_until_the_service_can(
    client: TestClient, backend: FakeBackend
) -> None:
    path = f"/api/v1/namespaces/{'AB' * 8}"
    assert_problem(client.delete(path, headers=AUTH), 501)
    backend.can_drop = True
    assert client.delete(path, headers=AUTH).json() == {"namespace_id": "ab" * 8, "dropped": 3}
    assert backend.dropped == ["ab" * 8]
    assert_problem(client.delete("/api/v1/namespaces/xyz", headers=AUTH), 422)


def test_drop_by_full_digest_drops_the_id_blocks_carry(
    client: TestClient, backend: FakeBackend
) -> None:
    backend.can_drop = True
    digest = "Cd" * 32
    r = client.delete(f"/api/v1/namespaces/{digest}", headers=AUTH)
    assert r.json() == {"namespace_id": "cd" * 8, "dropped": 3}
    assert backend.dropped == ["cd" * 8]
    for bad in ("cd" * 8 + "c", "cd" * 31 + "c", "cd" * 33, "zz" * 8, "cd" * 4):
        assert_problem(client.delete(f"/api/v1/namespaces/{bad}", headers=AUTH), 422)
    assert backend.dropped == ["cd" * 8]


# -- the page ----------------------------------------------------------------------------------


def test_dashboard_page_is_served_with_a_strict_policy(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    assert 'src="static/dashboard.js"' in r.text and "<script>" not in r.text
    js = client.get("/static/dashboard.js")
    assert js.status_code == 200 and "tier-bar" in js.text
    assert client.get("/static/dashboard.css").status_code == 200
    assert_problem(client.get("/static/../app.py"), 404)
