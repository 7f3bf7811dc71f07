"""Ray Serve LLM (``ray.serve.llm``) as an operator runs it from ``deploy/serve_llm_config.yaml``:
two replicas of SmolLM2-135M-Instruct on two cores sharing the context memory, through the
official OpenAI client.

The file as shipped is deployed by ``serve_llm_replicas_app`` (a cluster in a process of its
own). A prefix one replica computed and stored is loaded by the other (each whole response
names its replica in ``kv_transfer_params["cmx"]``), and the greedy output is the same tokens
as with the cache off. Once Serve, the service and the cluster are shut down, none of the
shared-memory segments the replicas' engines held is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import uuid
from typing import Any

import psutil
import pytest
from app_process import AppProcess

from cmx.operate.orphans import SEGMENT_PREFIXES, EngineSegments

MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 900  # a bound: two engines starting on two cores
ATTEMPTS = 30  # requests sent for the other replica to answer one: Serve picks at random
PREFIX_TOKENS = 384  # the whole 128-token blocks of the prompts' 400-token shared prefix
SHM = "/dev/shm"


def shm_segments() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(SEGMENT_PREFIXES)}


def held_by(pids: list[int], scratch: str) -> set[str]:
    """The segments these processes map or hold open now, as a replica's record names them."""
    record = EngineSegments(os.path.join(scratch, "probe")).record(pids)
    if record is None:
        return set()
    with open(record) as f:
        return set(json.load(f)["segments"])


def descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def prompt_ids(seed: int, n: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def complete(client: Any, ids: list[int], **extra: Any) -> dict[str, Any]:
    """A greedy completion of 8 tokens, as plain data (the vLLM fields included)."""
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return dict(r.model_dump())


def report(response: dict[str, Any]) -> dict[str, Any]:
    return dict((response.get("kv_transfer_params") or {}).get("cmx") or {})


def a_prefix_stored_by_one_replica_is_loaded_by_the_other(app: AppProcess) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{app.ready['base_url']}/v1", api_key="unused", timeout=300,
                    max_retries=0)
    prefix = prompt_ids(1)
    stored = report(complete(client, prefix + prompt_ids(2, 20)))
    first = stored["replica"]
    # Committed by the response, or still being stored then.
    assert stored.get("stored_tokens", 0) + stored.get("store_pending_tokens", 0) == PREFIX_TOKENS
    assert not stored.get("store_failed_tokens"), stored
    app.wait_stored(prefix, PREFIX_TOKENS)

    answered = []
    for attempt in range(ATTEMPTS):
        prompt = prefix + prompt_ids(100 + attempt, 20)
        hit = complete(client, prompt)
        answered.append(report(hit)["replica"])
        if answered[-1] != first:
            break
    assert answered[-1] != first, f"{ATTEMPTS} requests, all answered by {first}"
    # Loaded from the service: the replica that answered never saw the prefix.
    assert report(hit)["loaded_tokens"] == PREFIX_TOKENS, report(hit)

    off = complete(client, prompt, kv_transfer_params={"cmx": {"skip": True}},
                   cache_salt=f"cache-off-{uuid.uuid4().hex}")  # nor vLLM's own cache
    assert report(off).get("loaded_tokens", 0) == 0
    assert off["choices"][0]["token_ids"] == hit["choices"][0]["token_ids"]
    assert len(hit["choices"][0]["token_ids"]) == 8
    assert off["choices"][0]["text"] == hit["choices"][0]["text"]


@pytest.mark.timeout(START_TIMEOUT_S + 600)
def test_two_replicas_share_prefixes_and_leave_no_shared_memory() -> None:
    scratch = tempfile.mkdtemp(prefix="cmx-serve-llm-replicas-", dir="/var/tmp")
    state = os.path.join(scratch, "state")
    before = shm_segments()
    try:
        app = AppProcess("serve_llm_replicas_app.py", START_TIMEOUT_S, env={
            "CMX_STATE_DIR": state, "CMX_NVME_DIR": os.path.join(scratch, "nvme")})
        try:
            # The cluster's processes: the raylet, its workers, the engines under the replicas.
            engines = held_by(descendants(app.proc.pid), scratch) - before
            assert any(n.startswith("psm_") for n in engines), engines  # vLLM's, per engine
            a_prefix_stored_by_one_replica_is_loaded_by_the_other(app)
        finally:
            rc = app.stop()
        assert rc == 0
        assert not engines & shm_segments(), "left in /dev/shm by the stopped engines"
        # Nor any made later (vLLM's semaphores among them): what was made during the test and
        # is still there must be held by a live program, another one's.
        made = shm_segments() - before
        assert not made - held_by(psutil.pids(), scratch), "left in /dev/shm by the test"
        records = os.path.join(state, "engine-shm")
        assert not os.path.isdir(records) or not os.listdir(records)  # each reaped in full
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
