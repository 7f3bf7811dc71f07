"""The ingress's API key check, through the real FastAPI app of ``cmx.deploy.ingress``: with a
key file, a missing or unknown key is an OpenAI-style 401 before the body is read, and a known
key's request reaches the replica under its tenant's salt and block keys. The replica is a
stand-in for the ``LLMServer`` handle; the ingress is the real class, built by its own
``__init__`` (the tokenizer aside: these prompts are token ids)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from ingress_standin import ReplicaStandIn, servable_dependency

from cmx.deploy.apikeys import add_key
from cmx.deploy.auth import current_tenancy
from cmx.deploy.config import ServeOptions, TenantOptions
from cmx.deploy.ingress import OpenAIIngress, app
from cmx.deploy.messages import ReplicaInfo
from cmx.deploy.model import namespace_digest
from cmx.deploy.tenants import Tenancy, named_salt, tenant_salt
from cmx.keys import chain_keys

NAMESPACE: dict[str, object] = {"model": "m", "weights": "w", "num_layers": 2, "num_kv_heads": 1,
                                "head_dim": 16, "dtype": "float16", "block_tokens": 32}
INFO = ReplicaInfo(replica="r1", node="n1", model="m", namespace=NAMESPACE, block_tokens=32,
                   max_model_len=512, vocab_size=1000, cache=True)
PROMPT = list(range(1, 65))  # two blocks


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    path = str(tmp_path / "keys")
    keys = {"alice": add_key(path, "alice"), "bob": add_key(path, "bob")}
    monkeypatch.setattr("cmx.deploy.model.load_tokenizer", lambda _opts: None)
    replica = ReplicaStandIn(INFO, 7, "x")
    args = ServeOptions(tenants=TenantOptions(path)).to_args()
    args["engine"]["salt"] = "deploy"
    ingress = OpenAIIngress.__new__(OpenAIIngress)
    asyncio.run(OpenAIIngress.__init__(ingress, replica, args))  # Serve's wrapper: async
    # Outside a replica, Serve's context is missing: its two look-ups return this object.
    app.dependency_overrides[servable_dependency()] = lambda: ingress
    app.dependency_overrides[current_tenancy] = lambda: ingress.tenancy
    try:
        with TestClient(app) as client:
            yield {"client": client, "keys": keys, "replica": replica, "ingress": ingress}
    finally:
        app.dependency_overrides.clear()


def complete(client: TestClient, key: str | None, body: Any = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return client.post("/v1/completions", headers=headers,
                       json={"prompt": PROMPT, "max_tokens": 1} if body is None else body)


@pytest.mark.parametrize("key", [None, "", "cmx-not-a-key", "tenant-a"])
def test_a_missing_or_unknown_key_is_an_openai_401_before_the_body(
    served: dict[str, Any], key: str | None,
) -> None:
    client = served["client"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        r = client.post(path, headers=headers, content=b"{not json")  # never read
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "API key" in error["message"]
    assert served["replica"].requests == []


def test_a_known_key_reaches_the_replica_under_its_tenants_salt(served: dict[str, Any]) -> None:
    client, keys, replica = served["client"], served["keys"], served["replica"]
    for tenant in ("alice", "bob"):
        r = complete(client, keys[tenant])
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "x"
    alice, bob = replica.requests
    assert alice.salt == named_salt("deploy", "alice", None) != bob.salt
    assert bob.salt == named_salt("deploy", "bob", None)
    assert alice.keys == tuple(chain_keys(namespace_digest(NAMESPACE, alice.salt), PROMPT, 32))
    assert not set(alice.keys) & set(bob.keys)  # the same prompt, no block key in common
    salted = complete(client, keys["alice"], {"prompt": PROMPT, "cache_salt": "p"})
    assert salted.status_code == 200
    assert replica.requests[-1].salt == named_salt("deploy", "alice", "p")
    assert "deploy" not in r.text and alice.salt not in r.text


@pytest.mark.parametrize("mode", ["key file", "key file, anonymous", "no key file"])
def test_a_malformed_authorization_header_is_a_401_in_every_mode(
    served: dict[str, Any], mode: str,
) -> None:
    ingress, client, alice = served["ingress"], served["client"], served["keys"]["alice"]
    if mode == "key file, anonymous":
        ingress.tenancy = dataclasses.replace(ingress.tenancy, anonymous=True)
    elif mode == "no key file":
        ingress.tenancy = Tenancy("deploy")
    body = {"prompt": PROMPT, "max_tokens": 1}
    for header in (f"Token {alice}", f"Bearer\t{alice}", "Bearer", f"Basic {alice}",
                   f"Bearer {alice} {alice}"):
        r = client.post("/v1/completions", headers={"Authorization": header}, json=body)
        assert r.status_code == 401, (header.replace(alice, "<alice>"), r.text)
        assert "Authorization header is malformed" in r.json()["error"]["message"]
    assert served["replica"].requests == []  # no prompt ran, as no tenant
    assert client.post("/v1/completions", headers={"Authorization": f"Bearer {alice}"},
                       json=body).status_code == 200
    if mode != "key file":  # no header at all: the anonymous tenant, where it is served
        assert client.post("/v1/completions", json=body).status_code == 200


def test_without_a_key_file_any_key_is_its_own_tenant(served: dict[str, Any]) -> None:
    served["ingress"].tenancy = Tenancy("deploy")
    client, replica = served["client"], served["replica"]
    assert complete(client, "k1").status_code == 200
    assert complete(client, None).status_code == 200
    assert [r.salt for r in replica.requests] == [tenant_salt("deploy", "k1", None), "deploy"]


def test_routes_that_describe_the_deployment_answer_without_a_key(
    served: dict[str, Any],
) -> None:
    models = served["client"].get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"]
    assert served["client"].get("/cmx/info").status_code == 200
