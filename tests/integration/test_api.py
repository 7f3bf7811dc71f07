"""The admin API over the real service (two nodes), through uvicorn on a loopback port."""

from __future__ import annotations

import time
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import LAYOUT

T = LAYOUT.block_tokens
LAYOUT_SPEC = {"num_layers": LAYOUT.num_layers, "num_kv_heads": LAYOUT.num_kv_heads,
               "head_dim": LAYOUT.head_dim, "dtype": LAYOUT.dtype,
               "block_tokens": LAYOUT.block_tokens}


@pytest.fixture(scope="module")
def http(admin_api: Any) -> Any:
    with httpx.Client(base_url=admin_api.url, timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def auth(admin_api: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_api.token}"}


def stored(cm: Any, model: str, n_blocks: int, seed: int) -> tuple[Any, np.ndarray]:
    toks = np.random.default_rng(seed).integers(0, 50_000, n_blocks * T, dtype=np.uint32)
    ns = cm.namespace(model, LAYOUT, "t")
    assert ns.store(toks, LAYOUT.random_kv(len(toks), seed=seed)).wait() == n_blocks
    return ns, toks


def tier_of(view: dict[str, Any], node: str, tier: str) -> dict[str, Any]:
    entry = next(n for n in view["nodes"] if n["node"] == node)
    return next(t for t in entry["tiers"] if t["tier"] == tier)


def until(predicate: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError("timed out")


def test_every_tier_of_both_nodes_and_where_their_agents_run(
    http: httpx.Client, nodes: tuple[str, str]
) -> None:
    view = http.get("/api/v1/tiers").json()
    for node in nodes:
        entry = next(n for n in view["nodes"] if n["node"] == node)
        assert [t["tier"] for t in entry["tiers"]] == ["hbm", "dram", "nvme"]
        assert all(t["available"] and t["capacity_bytes"] > 0 for t in entry["tiers"])
        assert entry["tiers"][0]["emulated"] is True
        assert entry["agent"]["available"] and entry["agent"]["placed_on"] == node
    placements = {n["node"]: n for n in http.get("/api/v1/nodes").json()["nodes"]}
    assert all(placements[n]["placement"] == "host" for n in nodes)
    assert len(view["directory"]) == 2 and all(s["available"] for s in view["directory"])
    assert http.get("/readyz").json()["ready"] is True
    assert "enabled" in http.get("/api/v1/pool").json()


def test_lookup_block_pin_evict_through_the_api(
    http: httpx.Client, auth: dict[str, str], cm: Any, nodes: tuple[str, str]
) -> None:
    head, _ = nodes
    ns, toks = stored(cm, "m-api", 3, seed=101)
    body = {"model": "m-api", "salt": "t", "layout": LAYOUT_SPEC, "token_ids": toks.tolist()}
    found = http.post("/api/v1/lookup", json=body, headers=auth).json()
    assert found["namespace_id"] == ns.namespace.id
    assert found["num_tokens"] == 3 * T
    assert [b["key"] for b in found["blocks"]] == [k.hex() for k in ns.keys(toks)]

    key = found["blocks"][0]["key"]
    assert http.post("/api/v1/lookup", json=body).status_code == 401  # it tells what is cached
    assert http.get(f"/api/v1/blocks/{key}").status_code == 401
    copies = http.get(f"/api/v1/blocks/{key}", headers=auth).json()["copies"]
    dram = next(c for c in copies if c["tier"] == "dram" and c["node"] == head)
    ref = {"key": key, "node": dram["node"], "tier": "dram"}
    assert http.post("/api/v1/pin", json=ref).status_code == 401
    assert http.post("/api/v1/pin", json=ref, headers=auth).json()["done"] is True
    until(lambda: tier_of(http.get("/api/v1/tiers").json(), head, "dram")["pinned"] >= 1)

    evict = {"keys": [key], "tier": "dram", "node": head[:12]}
    assert http.post("/api/v1/evict", json=evict, headers=auth).json()["evicted"] == 0
    assert http.post("/api/v1/unpin", json=ref, headers=auth).json()["done"] is True
    assert http.post("/api/v1/evict", json=evict, headers=auth).json()["evicted"] == 1
    after = http.get(f"/api/v1/blocks/{key}", headers=auth)
    assert all(c["tier"] != "dram" or c["node"] != head for c in after.json().get("copies", []))

    everywhere = http.post("/api/v1/evict", json={"keys": [b["key"] for b in found["blocks"]]},
                           headers=auth).json()
    assert everywhere["evicted"] >= 2 and not everywhere["unavailable"]
    assert http.post("/api/v1/lookup", json=body, headers=auth).json()["num_blocks"] == 0


def test_bad_input_is_a_problem_document_never_a_5xx(
    http: httpx.Client, auth: dict[str, str]
) -> None:
    for method, path, kwargs, status in [
        ("GET", "/api/v1/blocks/not-a-key", {}, 422),
        ("GET", f"/api/v1/blocks/{'00' * 32}", {}, 404),
        ("GET", "/api/v1/nodes/abcdef0123", {}, 404),
        ("POST", "/api/v1/pin", {"json": {"key": "00" * 32, "node": "abcdef", "tier": "dram"}},
         404),
        ("POST", "/api/v1/evict", {"json": {"keys": ["00"]}}, 422),
        ("POST", "/api/v1/lookup", {"json": {"model": "m"}}, 422),
    ]:
        r = http.request(method, path, headers=auth, **kwargs)  # type: ignore[arg-type]
        assert r.status_code == status, (path, r.text)
        assert r.headers["content-type"] == "application/problem+json"


def test_drop_namespace_empties_only_that_namespace(
    http: httpx.Client, auth: dict[str, str], cm: Any
) -> None:
    keep, toks = stored(cm, "m-api-drop", 2, seed=102)
    drop = cm.namespace("m-api-drop", LAYOUT, "other")
    drop.store(toks, LAYOUT.random_kv(len(toks), seed=103)).wait()
    r = http.delete(f"/api/v1/namespaces/{drop.namespace.id}", headers=auth)
    assert r.status_code == 200 and r.json()["dropped"] >= 2
    assert drop.lookup(toks).num_tokens == 0
    assert keep.lookup(toks).num_tokens == len(toks)


def test_drop_by_digest_reaches_every_tier_that_holds_a_copy(
    http: httpx.Client, auth: dict[str, str], cm: Any
) -> None:
    import ray

    keep, toks = stored(cm, "m-api-digest", 2, seed=106)
    drop = cm.namespace("m-api-digest", LAYOUT, "other")
    assert drop.store(toks, LAYOUT.random_kv(len(toks), seed=107)).wait() == 2
    stored(cm, "m-api-digest-filler", 16, seed=108)  # pushes both out of DRAM onto NVMe
    assert ray.get(drop.prefetch(toks), timeout=30) == 2  # and back up into HBM
    keys = drop.keys(toks)
    held = {c.tier.value for copies in cm.copies(keys) for c in copies}
    copies = sum(len(c) for c in cm.copies(keys))

    r = http.delete(f"/api/v1/namespaces/{drop.namespace.digest.hex()}", headers=auth)
    assert r.status_code == 200, r.text
    assert r.json() == {"namespace_id": drop.namespace.id, "dropped": copies}
    assert {"hbm", "nvme"} <= held and cm.copies(keys) == [[], []]
    assert drop.lookup(toks).num_tokens == 0
    assert keep.lookup(toks).num_tokens == len(toks)
    bad = http.delete(f"/api/v1/namespaces/{drop.namespace.digest.hex()[:40]}", headers=auth)
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"


def test_metrics_parse_and_match_the_json_view(
    http: httpx.Client, cm: Any, nodes: tuple[str, str]
) -> None:
    head, _ = nodes
    stored(cm, "m-api-metrics", 2, seed=104)

    def scrape() -> dict[str, Any] | None:
        text = http.get("/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        used = {(s.labels["node"], s.labels["tier"]): s.value
                for s in families["cmx_tier_used_bytes"].samples}
        return families if used.get((head, "dram"), 0) > 0 else None

    families = until(scrape)  # answers come from a sample up to sample_s old
    assert all(name.startswith("cmx_") for name in families)
    used = {(s.labels["node"], s.labels["tier"]) for s in families["cmx_tier_used_bytes"].samples}
    assert {(n, t) for n in nodes for t in ("hbm", "dram", "nvme")} <= used
    counts = {s.labels["node"]: s.value for s in families["cmx_transfer_latency_seconds"].samples
              if s.name.endswith("_count") and s.labels["op"] == "store"}
    assert counts[head] >= 1
    moved = [s for s in families["cmx_moved_bytes"].samples
             if s.labels == {"node": head, "src": "client", "dst": "dram"}]
    assert moved and moved[0].value > 0
    depth = {s.labels["priority"] for s in families["cmx_agent_queue_depth"].samples}
    assert depth == {"load", "prefetch", "demote"}


def test_history_shows_the_bandwidth_of_a_store(
    http: httpx.Client, cm: Any, nodes: tuple[str, str]
) -> None:
    head, _ = nodes

    def dram_in_rate() -> float:
        series = http.get("/api/v1/history", params={"window_s": 60}).json()["series"]
        points = next(s["points"] for s in series if s["node"] == head and s["tier"] == "dram")
        return max((p["in_bytes_per_s"] or 0.0) for p in points)

    time.sleep(1.2)  # at least one sample before the store
    stored(cm, "m-api-rate", 4, seed=105)
    assert until(dram_in_rate) > 0


def test_the_same_figures_reach_rays_metrics_export(cm: Any, nodes: tuple[str, str]) -> None:
    import ray

    head = next(n for n in ray.nodes() if n["NodeID"] == nodes[0])
    url = f"http://{head['NodeManagerAddress']}:{head['MetricsExportPort']}/metrics"

    def exported() -> bool:
        text = httpx.get(url, timeout=10).text
        return "ray_cmx_tier_used_bytes" in text and "ray_cmx_transfer_latency_seconds" in text

    assert until(exported, timeout_s=90)
