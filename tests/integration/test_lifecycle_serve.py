"""`cmx serve` on a machine where a Ray token exists: the head it starts turns token
authentication on, and `cmx serve` joins it as Ray's own CLI would; the official `openai`
client, streaming and not, gets the same tokens with and without the cache and the cached
tokens in its usage; `--stop` leaves no dead head in Ray's current-cluster file."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from lifecycle_support import free_port, new_machine

from cmx.operate.local_ray import port_open


@pytest.mark.timeout(900)
def test_serve_starts_and_stops_with_token_authentication(tmp_path: Path) -> None:
    m = new_machine(tmp_path)
    gcs, http = free_port(), free_port()
    m.env.pop("CMX_BLOCK_BYTES")  # the served model's blocks size the slots

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cmx.cli", "serve", *args], env=m.env,
                              capture_output=True, text=True, timeout=600)

    started = serve("--replicas", "1", "--port", str(http), "--address", f"127.0.0.1:{gcs}",
                    "--dtype", "float32")  # float32: same tokens with and without the cache
    try:
        assert started.returncode == 0, started.stderr[-4000:]
        base = started.stdout.strip().splitlines()[-1]
        assert httpx.get(f"{base}/models", timeout=30).status_code == 200
        openai_client_gets_the_same_tokens_and_cached_tokens(base)
    finally:
        stopped = serve("--stop")
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert not port_open("127.0.0.1", gcs)
    assert not m.current_cluster_file.exists()
    shutil.rmtree(m.ray_tmp, ignore_errors=True)


def openai_client_gets_the_same_tokens_and_cached_tokens(base: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base, api_key="tenant", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 40000) for _ in range(300)]
    args: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 8,
                            "temperature": 0}
    first = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.prompt_tokens == 300
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
