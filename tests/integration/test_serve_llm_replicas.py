"""Ray Serve LLM (``ray.serve.llm``) as an operator runs it from ``deploy/serve_llm_config.yaml``:
two replicas of SmolLM2-135M-Instruct on two cores sharing the context memory, through the
official OpenAI client.

The file as shipped is deployed by ``serve_llm_replicas_app`` (a cluster in a process of its
own). A prefix one replica computed and stored is loaded by the other (each whole response
names its replica in ``kv_transfer_params["cmx"]``), and the greedy output is the same tokens
as with the cache off. Serve shut down (``serve shutdown``), none of the shared-memory segments
the replicas' engines held is left in /dev/shm while the service runs on; the cluster torn down
then, as ``serve run`` does on Ctrl-C, none of the service's arenas either.

``serve run deploy/serve_llm_config.yaml`` itself (one replica), stopped with SIGTERM as a
process manager stops it: Ray tears its cluster down without stopping Serve, and still nothing
of the engines or of the service is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from importlib import resources
from typing import Any

import httpx
import psutil
import pytest
import yaml
from app_process import AppProcess

from cmx.operate.orphans import EngineSegments, is_engine_segment

MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 900  # a bound: two engines starting on two cores
ATTEMPTS = 30  # requests sent for the other replica to answer one: Serve picks at random
PREFIX_TOKENS = 384  # the whole 128-token blocks of the prompts' 400-token shared prefix
SHM = "/dev/shm"
CONFIG = "serve_llm_config.yaml"  # in cmx.deploy, as the package ships it
# Each test stops a whole Ray cluster of its own by a signal or Serve's shutdown, and counts what
# that cluster's processes leave: it runs in a pytest run of its own (``make test``), with no
# session cluster and no other suite's engines beside it.
pytestmark = pytest.mark.apart


def shm_segments() -> set[str]:
    return {n for n in os.listdir(SHM) if is_engine_segment(n)}


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
    # Loaded from the service: the replica that answered never saw the prefix. The usage
    # says so as the OpenAI API does.
    assert report(hit)["loaded_tokens"] == PREFIX_TOKENS, report(hit)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == PREFIX_TOKENS, hit["usage"]

    off = complete(client, prompt, kv_transfer_params={"cmx": {"skip": True}},
                   cache_salt=f"cache-off-{uuid.uuid4().hex}")  # nor vLLM's own cache
    assert report(off).get("loaded_tokens", 0) == 0
    assert off["choices"][0]["token_ids"] == hit["choices"][0]["token_ids"]
    assert len(hit["choices"][0]["token_ids"]) == 8
    assert off["choices"][0]["text"] == hit["choices"][0]["text"]


@pytest.mark.timeout(START_TIMEOUT_S + 600)
def test_two_replicas_share_prefixes_and_leave_no_shared_memory() -> None:
    scratch = tempfile.mkdtemp(prefix="cmx-serve-llm-replicas-", dir="/var/tmp")
    # Ray's own: a cluster another `ray start` left on this machine is not joined.
    ray_tmp = tempfile.mkdtemp(prefix="cmxr-", dir="/tmp")
    state = os.path.join(scratch, "state")
    before = shm_segments()
    try:
        app = AppProcess("serve_llm_replicas_app.py", START_TIMEOUT_S, env={
            "CMX_STATE_DIR": state, "CMX_NVME_DIR": os.path.join(scratch, "nvme"),
            "RAY_TMPDIR": ray_tmp})
        try:
            # The cluster's processes: the raylet, its workers, the engines under the replicas.
            cluster = descendants(app.proc.pid)
            engines = held_by(cluster, scratch) - before
            assert any(n.startswith("psm_") for n in engines), engines  # vLLM's, per engine
            arenas = arenas_of(cluster)  # the service's tiers, started by the first engine
            assert {n.split("-")[1] for n in arenas} >= {"hbm", "dram"}, arenas
            a_prefix_stored_by_one_replica_is_loaded_by_the_other(app)
            # Nor what they opened since (vLLM's semaphores among them). Only what the cluster's
            # processes hold is counted: other programs on the machine make and leave theirs.
            engines |= held_by(descendants(app.proc.pid), scratch) - before
            assert app.ask({"serve_shutdown": True}, timeout_s=300) == {"shut_down": True}
            assert not engines & shm_segments(), "left in /dev/shm by the stopped engines"
            assert arenas <= set(os.listdir(SHM))  # the service runs on: its tiers hold them
        finally:
            rc = app.stop()
        assert rc == 0
        assert wait_until(lambda: not arenas & set(os.listdir(SHM)), 60), \
            f"left in /dev/shm by the service: {sorted(arenas & set(os.listdir(SHM)))}"
        records = os.path.join(state, "engine-shm")
        assert not os.path.isdir(records) or not os.listdir(records)  # each reaped in full
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def arenas_of(pids: list[int]) -> set[str]:
    """The service's arenas in /dev/shm that these processes created (and own)."""
    from cmx.storage.arena import owner_of

    return {n for n in os.listdir(SHM) if n.startswith("cmx-") and owner_of(n) in set(pids)}


def session_of(sid: int) -> list[int]:
    """The processes of session ``sid`` (a process started in a session of its own and all it
    started, Ray's cluster included)."""
    found = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid:
                found.append(pid)
        except OSError:
            continue
    return found


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.5)
    return done()


def serve_run_config(scratch: str) -> tuple[str, str]:
    """The shipped file with one replica, served on a free loopback port (another run on the
    machine may hold 8000): its path, and the application's URL."""
    from cmx.deploy.local import free_port

    config = yaml.safe_load(resources.files("cmx.deploy").joinpath(CONFIG).read_text())
    port = free_port()
    config["http_options"] = {**config["http_options"], "host": "127.0.0.1", "port": port}
    config["applications"][0]["args"]["replicas"] = 1
    path = os.path.join(scratch, CONFIG)
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path, f"http://127.0.0.1:{port}"


def wait_serving(run: subprocess.Popen[bytes], base: str, log: str) -> None:
    body = {"model": MODEL, "prompt": prompt_ids(7), "max_tokens": 2, "temperature": 0}
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert run.poll() is None, f"serve run exited ({run.returncode}):\n{tail(log)}"
        try:
            if httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    raise TimeoutError(f"serve run did not serve within {START_TIMEOUT_S} s:\n{tail(log)}")


def tail(log: str) -> str:
    with open(log, errors="replace") as f:
        return f.read()[-4000:]


@pytest.mark.timeout(START_TIMEOUT_S + 600)
def test_serve_run_stopped_by_sigterm_leaves_no_shared_memory() -> None:
    scratch = tempfile.mkdtemp(prefix="cmx-serve-run-", dir="/var/tmp")
    ray_tmp = tempfile.mkdtemp(prefix="cmxr-", dir="/tmp")  # Ray's socket paths stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CMX_", "RAY_"))}
    env.update({"CMX_STATE_DIR": os.path.join(scratch, "state"), "RAY_TMPDIR": ray_tmp,
                "CMX_NVME_DIR": os.path.join(scratch, "nvme"), "RAY_DISABLE_USAGE_STATS": "1"})
    config, base = serve_run_config(scratch)
    log = os.path.join(scratch, "serve-run.log")
    try:
        with open(log, "wb") as out:
            run = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "serve"),
                                    "run", config], cwd=scratch, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_serving(run, base, log)
            tree = session_of(run.pid)
            engines = held_by(tree, scratch)
            arenas = arenas_of(tree)
            assert any(n.startswith("psm_") for n in engines), engines
            assert {n.split("-")[1] for n in arenas} >= {"hbm", "dram"}, arenas
            run.send_signal(signal.SIGTERM)
            run.wait(timeout=120)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        assert wait_until(lambda: not session_of(run.pid), 120), "the cluster outlived serve run"
        left = lambda: (engines | arenas) & set(os.listdir(SHM))  # noqa: E731
        assert wait_until(lambda: not left(), 60), f"left in /dev/shm: {sorted(left())}"
        records = os.path.join(scratch, "state", "engine-shm")
        assert not os.path.isdir(records) or not os.listdir(records)  # each reaped in full
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
