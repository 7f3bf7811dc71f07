"""The admin API as a Ray Serve ingress application beside the service."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest

from cmx.api.serve import admin_deployment
from cmx.config import AdminConfig

APP = "cmx-admin-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(600)
def test_admin_api_served_by_serve_under_a_route_prefix(
    cm: Any, config: Any, nodes: tuple[str, str]
) -> None:
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    had_serve = any(a["name"] == "SERVE_CONTROLLER_ACTOR"
                    for a in ray.util.list_named_actors(all_namespaces=True))
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port  # Serve may already run on another port
    admin = AdminConfig(token="serve-admin-token-0123", sample_s=1.0)
    serve.run(admin_deployment(config, admin, name="cmx-admin").bind(), name=APP,
              route_prefix="/cmx-admin")
    try:
        base = f"http://127.0.0.1:{port}/cmx-admin"
        view = httpx.get(f"{base}/api/v1/tiers", timeout=60).json()
        assert set(nodes) <= {n["node"] for n in view["nodes"]}
        r = httpx.post(f"{base}/api/v1/evict", json={"keys": ["00" * 32]}, timeout=30)
        assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json"
        bare = httpx.get(base, timeout=30)
        assert bare.status_code == 307 and bare.headers["location"].endswith("/cmx-admin/")
        page = httpx.get(f"{base}/", timeout=30)
        assert page.status_code == 200 and 'src="static/dashboard.js"' in page.text
        assert httpx.get(f"{base}/static/dashboard.js", timeout=30).status_code == 200
        assert "cmx_tier_used_bytes" in httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        serve.delete(APP)
        if not had_serve:
            serve.shutdown()
