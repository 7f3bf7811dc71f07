"""`cmx serve --prefill-replicas 1`: one replica computes each prompt and stores its KV, the
other loads it and decodes, behind one OpenAI endpoint. The official `openai` client gets the
tokens a replica computing the prompt itself gives (the cache off), and the decode's usage
names the prompt's tokens it loaded."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lifecycle_support import free_port, new_machine

from cmx.operate.local_ray import port_open


@pytest.mark.timeout(900)
def test_prefill_and_decode_replicas_answer_as_one_replica_computing_alone(
    tmp_path: Path,
) -> None:
    from openai import OpenAI

    m = new_machine(tmp_path)
    gcs, http = free_port(), free_port()
    m.env.pop("CMX_BLOCK_BYTES")  # the served model's blocks size the slots

    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cmx.cli", "serve", *args], env=m.env,
                              capture_output=True, text=True, timeout=600)

    started = serve("--replicas", "1", "--prefill-replicas", "1", "--port", str(http),
                    "--address", f"127.0.0.1:{gcs}", "--dtype", "float32")
    try:
        assert started.returncode == 0, started.stderr[-4000:]
        client = OpenAI(base_url=started.stdout.strip().splitlines()[-1], api_key="none",
                        timeout=300, max_retries=0)
        rng = random.Random(11)
        args: dict[str, Any] = {"model": client.models.list().data[0].id, "max_tokens": 8,
                                "prompt": [rng.randrange(1000, 40000) for _ in range(300)],
                                "temperature": 0, "extra_body": {"ignore_eos": True}}
        # The first time the prompt is seen: the prefill replica computed it, the decode
        # replica loaded its whole 128-token blocks.
        split = client.completions.create(**args)
        assert split.usage is not None and split.usage.prompt_tokens_details is not None
        assert split.usage.prompt_tokens_details.cached_tokens == 256
        # The cache off: the decode replica computes the prompt itself.
        alone = client.completions.create(**{**args, "extra_body": {"ignore_eos": True,
                                                                     "cache": False}})
        assert alone.usage is not None and alone.usage.prompt_tokens_details is not None
        assert alone.usage.prompt_tokens_details.cached_tokens == 0
        assert split.choices[0].text == alone.choices[0].text
        streamed = list(client.completions.create(**args, stream=True))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == alone.choices[0].text
    finally:
        stopped = serve("--stop")
    assert stopped.returncode == 0, stopped.stderr[-4000:]
    assert not port_open("127.0.0.1", gcs)
    shutil.rmtree(m.ray_tmp, ignore_errors=True)
