"""`cmx serve` on a machine where a Ray token exists: the head it starts turns token
authentication on, and `cmx serve` joins it as Ray's own CLI would; the official `openai`
client, streaming and not, gets the same tokens with and without the cache and the cached
tokens in its usage; with an API key file made by `cmx keys add`, a wrong key is refused and two
tenants never see each other's cached tokens; `--stop` leaves no dead head in Ray's
current-cluster file."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from lifecycle_support import Machine, free_port, new_machine

from cmx.operate.local_ray import port_open


@pytest.mark.timeout(900)
def test_serve_starts_and_stops_with_token_authentication(tmp_path: Path) -> None:
    m = new_machine(tmp_path)
    gcs, http = free_port(), free_port()
    m.env.pop("CMX_BLOCK_BYTES")  # the served model's blocks size the slots
    keys = {t: add_key(m, t) for t in ("alice", "bob")}
    m.env["CMX_API_KEY_FILE"] = str(m.root / "api-keys")

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cmx.cli", "serve", *args], env=m.env,
                              capture_output=True, text=True, timeout=600)

    started = serve("--replicas", "1", "--port", str(http), "--address", f"127.0.0.1:{gcs}",
                    "--dtype", "float32")  # float32: same tokens with and without the cache
    try:
        assert started.returncode == 0, started.stderr[-4000:]
        base = started.stdout.strip().splitlines()[-1]
        assert httpx.get(f"{base}/models", timeout=30).status_code == 200
        openai_client_gets_the_same_tokens_and_cached_tokens(base, keys["alice"])
        tenants_see_only_their_own_cached_tokens(base, keys["bob"])
    finally:
        stopped = serve("--stop")
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert not port_open("127.0.0.1", gcs)
    assert not m.current_cluster_file.exists()
    shutil.rmtree(m.ray_tmp, ignore_errors=True)


def add_key(m: Machine, tenant: str) -> str:
    """A new key of ``tenant`` in the machine's key file, as an operator makes one."""
    made = subprocess.run([sys.executable, "-m", "cmx.cli", "keys", "add", tenant, "--file",
                           str(m.root / "api-keys")], env=m.env, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def completion_args(client: Any) -> dict[str, Any]:
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 40000) for _ in range(300)]
    return {"model": client.models.list().data[0].id, "prompt": prompt, "max_tokens": 8,
            "temperature": 0}


def cached_tokens(reply: Any) -> int:
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return int(reply.usage.prompt_tokens_details.cached_tokens)


def tenants_see_only_their_own_cached_tokens(base: str, key: str) -> None:
    """A second tenant sends the first's prompt twice: its first request finds none of the
    first tenant's blocks, its second finds its own. A key the file lacks is a 401."""
    import openai

    client = openai.OpenAI(base_url=base, api_key=key, timeout=300, max_retries=0)
    args = {**completion_args(client), "extra_body": {"ignore_eos": True}}
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="cmx-wrong").completions.create(**args)
    assert cached_tokens(client.completions.create(**args)) == 0
    assert cached_tokens(client.completions.create(**args)) == 256


def openai_client_gets_the_same_tokens_and_cached_tokens(base: str, key: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base, api_key=key, timeout=300, max_retries=0)
    args = completion_args(client)
    first = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.prompt_tokens == 300
    assert cached_tokens(first) == 0
    # The same prompt again, streamed: its blocks are cached now (whole 128-token blocks).
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 256
    # With the cache off: computed from scratch, the same tokens.
    fresh = client.completions.create(**args, extra_body={"ignore_eos": True, "cache": False})
    assert fresh.usage is not None and fresh.usage.prompt_tokens_details is not None
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert streamed == first.choices[0].text == fresh.choices[0].text
