"""vLLM in a replica: the engine's settings on its node (``engine_settings``: vLLM's CPU build or
its CUDA one, by what ``cmx.deploy.devices.NodeDevices`` says the node has), its arguments, and
the ``kv_transfer_config`` that plugs in the context memory — the one setting a vLLM user
changes to adopt it:

    kv_transfer_config={"kv_connector": "CMXConnector",
                        "kv_connector_module_path": "cmx.connectors.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {...}}

The same replica runs with no connector, or with vLLM's own ``ExampleConnector`` (its disk
connector), so benchmarks compare the three on one code path.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any

from cmx.config import ServiceConfig
from cmx.deploy.config import ServeOptions
from cmx.deploy.devices import Accelerator, DeviceMismatch, NodeDevices
from cmx.deploy.model import ModelInfo

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "EngineSettings", "build_engine", "engine_args",
           "engine_settings", "transfer_config"]

log = logging.getLogger(__name__)

CONNECTOR_CLASS = "CMXConnector"
CONNECTOR_MODULE = "cmx.connectors.vllm"


def transfer_config(options: ServeOptions, model: ModelInfo, service: ServiceConfig,
                    ray_address: str = "", node_id: str = "",
                    kv_role: str = "kv_both") -> dict[str, Any] | None:
    """The ``kv_transfer_config`` of ``options.engine.connector`` (None: no connector);
    ``kv_role`` "kv_producer" for a replica that only prefills, "kv_consumer" for one that
    decodes what those stored."""
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
            "kv_role": kv_role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


@dataclass(frozen=True)
class EngineSettings:
    """How a replica's vLLM runs on its node (``engine_settings``)."""

    accelerator: Accelerator
    enforce_eager: bool  # True on CPU: vLLM's CPU backend captures no CUDA graphs
    env: Mapping[str, str]  # set before the engine starts, which reads them then
    env_defaults: Mapping[str, str]  # set where the environment has none

    def apply(self, environ: MutableMapping[str, str]) -> None:
        environ.update(self.env)
        for name, value in self.env_defaults.items():
            environ.setdefault(name, value)


def engine_settings(options: ServeOptions, node: NodeDevices) -> EngineSettings:
    """The engine's settings on ``node``: the one place a replica chooses them.

    - torch sees a CUDA device: vLLM's CUDA defaults (CUDA graphs, the KV cache sized from the
      GPU's memory by ``gpu_memory_utilization``); none of the CPU backend's variables;
    - it sees none and Ray assigned the replica no GPU: vLLM's CPU backend, its KV cache
      ``engine.kv_cache_gib`` (``VLLM_CPU_KVCACHE_SPACE``), ``options.threads`` OpenMP threads
      (Ray sets ``OMP_NUM_THREADS`` in its workers, so it is overwritten), eager execution;
    - Ray assigned a GPU that torch does not see: ``DeviceMismatch``.

    The dtype is ``engine.dtype`` on both, as the options say.
    """
    # Prompts may be longer than the model was trained on (the benchmark's 16K tokens): vLLM
    # refuses a max_model_len over the model's unless told.
    defaults = {"VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    if node.cuda_devices:
        return EngineSettings(Accelerator.CUDA, enforce_eager=False, env={},
                              env_defaults=defaults)
    if node.ray_gpus:
        raise DeviceMismatch(
            f"Ray assigned this replica {node.ray_gpus} GPU(s) and torch sees no CUDA device: "
            "GPU hosts run the image Dockerfile.gpu builds (torch's CUDA wheel, vLLM's CUDA "
            "build), and CUDA_VISIBLE_DEVICES must name the assigned GPU")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(options.engine.kv_cache_gib))),
           "OMP_NUM_THREADS": str(options.threads)}
    return EngineSettings(Accelerator.CPU, enforce_eager=True, env=env,
                          env_defaults={"VLLM_CPU_OMP_THREADS_BIND": "nobind", **defaults})


def engine_args(options: ServeOptions, model: ModelInfo, kv_transfer: dict[str, Any] | None,
                settings: EngineSettings) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    eng = options.engine
    return AsyncEngineArgs(
        model=model.path, served_model_name=model.name, tokenizer=model.path,
        dtype=eng.dtype, block_size=eng.block_size, max_model_len=eng.max_model_len,
        max_num_seqs=eng.max_num_seqs, enforce_eager=settings.enforce_eager,
        enable_prefix_caching=True, seed=0, disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None,
    )


def build_engine(options: ServeOptions, model: ModelInfo, kv_transfer: dict[str, Any] | None,
                 node: NodeDevices | None = None) -> Any:
    """vLLM's ``AsyncLLM`` (its engine core in a process of its own), set for ``node`` (None:
    this process's, ``NodeDevices.here``)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    settings = engine_settings(options, node or NodeDevices.here())
    log.info("vLLM on %s", settings.accelerator.value)
    settings.apply(os.environ)
    return AsyncLLM.from_engine_args(engine_args(options, model, kv_transfer, settings))
