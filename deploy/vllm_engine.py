"""vLLM in a replica: the engine's arguments, and the ``kv_transfer_config`` that plugs in the
context memory — the one setting a vLLM user changes to adopt it:

    kv_transfer_config={"kv_connector": "CMXConnector",
                        "kv_connector_module_path": "cmx.connectors.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {...}}

The same replica runs with no connector, or with vLLM's own ``ExampleConnector`` (its disk
connector), so benchmarks compare the three on one code path.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from typing import Any

from cmx.config import ServiceConfig
from cmx.deploy.config import ServeOptions
from cmx.deploy.model import ModelInfo

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "build_engine", "engine_args", "set_cpu_env",
           "transfer_config"]

CONNECTOR_CLASS = "CMXConnector"
CONNECTOR_MODULE = "cmx.connectors.vllm"


def transfer_config(options: ServeOptions, model: ModelInfo, service: ServiceConfig,
                    ray_address: str = "", node_id: str = "") -> dict[str, Any] | None:
    """The ``kv_transfer_config`` of ``options.engine.connector`` (None: no connector)."""
    eng = options.engine
    if eng.connector == "none":
        return None
    if eng.connector == "example":
        # Every replica of the application shares one directory, so one's stores are the
        # other's hits (on one machine; across machines it would be a shared filesystem).
        path = os.path.join(tempfile.gettempdir(), f"cmx-example-connector-{options.app_name}")
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": path}}
    # The namespace's model and weights are named here, as the ingress names them for the
    # router's keys; the tenant's salt arrives with each request as its cache_salt.
    extra = {
        "model": model.name, "weights": model.weights, "block_tokens": eng.block_size,
        "service": asdict(service), "ray_address": ray_address, "margin": eng.margin,
        "gate": eng.gate,
    }
    if node_id:
        # vLLM's engine core runs in a process of its own on this replica's host; it joins the
        # cluster as a driver, and on a host with several raylets a driver joins the head's.
        extra["node_id"] = node_id
    return {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def set_cpu_env(options: ServeOptions) -> None:
    """vLLM's CPU backend settings, read from the environment when the engine starts."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(options.engine.kv_cache_gib)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(options.threads)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # Prompts may be longer than the model was trained on (the benchmark's 16K tokens): vLLM
    # refuses a max_model_len over the model's unless told.
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def engine_args(options: ServeOptions, model: ModelInfo,
                kv_transfer: dict[str, Any] | None) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    eng = options.engine
    return AsyncEngineArgs(
        model=model.path, served_model_name=model.name, tokenizer=model.path,
        dtype=eng.dtype, block_size=eng.block_size, max_model_len=eng.max_model_len,
        max_num_seqs=eng.max_num_seqs, enforce_eager=True, enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None, seed=0,
        disable_log_stats=True,
    )


def build_engine(options: ServeOptions, model: ModelInfo,
                 kv_transfer: dict[str, Any] | None) -> Any:
    """vLLM's ``AsyncLLM`` (its engine core in a process of its own)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    set_cpu_env(options)
    return AsyncLLM.from_engine_args(engine_args(options, model, kv_transfer))
