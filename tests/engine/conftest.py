"""One Ray cluster, one service and the engines for every engine test.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its scheduler-side and
worker-side connectors are both here, so a test can reach the worker's connector. The test of
a fresh engine in another process runs vLLM with multiprocessing on, the default. Engines are
small: SmolLM2-135M, 1 GiB of KV cache, eager mode, 32-token blocks.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from cmx.config import ServiceConfig

from .vllm_support import MAX_TOKENS, engine_kwargs, prompts, set_engine_env, transfer_config

MiB = 1 << 20

@pytest.fixture(scope="package")
def service() -> Iterator[ServiceConfig]:
    root = tempfile.mkdtemp(prefix="cmx-engine-")
    yield ServiceConfig(block_bytes=2 * MiB, hbm_bytes=32 * MiB, dram_bytes=96 * MiB,
                        nvme_bytes=256 * MiB, nvme_dir=root, nvme_segment_bytes=32 * MiB,
                        call_timeout_s=20.0, load_timeout_s=30.0)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="package")
def cm(service: ServiceConfig) -> Iterator[Any]:
    """The service on a Ray cluster of this package's own."""
    import ray

    from cmx.client import ContextMemory

    if ray.is_initialized():
        raise RuntimeError("the engine tests start a Ray cluster of their own: run them before "
                           "(or apart from) tests that leave one connected")
    set_engine_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # A cluster of our own by address: a bare ray.init() would join any cluster running here.
    cluster = start_cluster()
    ray.init(address=cluster.address, namespace="cmx")
    memory = ContextMemory.connect(config=service)
    yield memory
    memory.shutdown(stop_service=True)
    ray.shutdown()
    cluster.shutdown()


def start_cluster(attempts: int = 3) -> Any:
    """A one-node cluster; Ray gives a raylet 30 s to register, which a loaded machine can miss,
    so a timed-out start is tried again."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        try:
            return Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception on this timeout
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="package")
def baseline(cm: Any) -> dict[str, list[int]]:
    """Greedy tokens of every prompt from vLLM without a connector, one prompt at a time (as the
    tests send them: a batch of another shape may round differently)."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(enable_prefix_caching=False))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    tokens = {p: list(llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids)
              for p in prompts()}
    del llm
    gc.collect()
    return tokens


@pytest.fixture(scope="package")
def engine(cm: Any, service: ServiceConfig, baseline: Any) -> Iterator[Any]:
    """vLLM with CMXConnector, its own prefix cache off: every hit comes from the service.
    Gating is off so every hit is loaded: these tests are about what is loaded."""
    from vllm import LLM

    llm = LLM(**engine_kwargs(enable_prefix_caching=False),
              kv_transfer_config=transfer_config(service, gate=False))
    yield llm
    del llm
    gc.collect()
