"""The Serve application: ``OpenAIIngress`` -> ``LLMServer`` x N (vLLM with the context memory
as its KV connector), routed by ``PrefixAwareRouter``. With ``prefill_replicas`` the ingress
sends each prompt to an ``LLMPrefill`` replica first (one token; its KV stored), then the
request to an ``LLMServer`` replica, which loads that KV and decodes.

    from ray import serve
    from cmx.deploy.app import build
    from cmx.deploy.config import ServeOptions
    serve.run(build(ServeOptions(replicas=2)), name="cmx-llm", route_prefix="/")

or from a Serve config (``deploy/serve_config.yaml``, KubeRay's ``serveConfigV2``):
``import_path: cmx.deploy.app:build_app`` with ``ServeOptions.to_args()`` as ``args``.
"""

from __future__ import annotations

from typing import Any

from cmx.deploy.config import ServeOptions
from cmx.errors import CmxError

__all__ = ["ROUTER_CLASS", "build", "build_app", "check_block_size", "check_options",
           "router_kwargs"]

ROUTER_CLASS = "cmx.deploy.router:PrefixAwareRouter"


def router_kwargs(options: ServeOptions) -> dict[str, Any]:
    shards = options.service.directory_shards if options.service else options.directory_shards
    return {"block_tokens": options.engine.block_size,
            "chunk_tokens": options.engine.block_size, "directory_shards": shards,
            "lookup_timeout_s": options.route_lookup_timeout_s}


def check_block_size(options: ServeOptions) -> None:
    """Refuse, before anything is deployed, slots that cannot hold one of the model's blocks:
    ``CmxError`` naming the ``CMX_BLOCK_BYTES`` to set (``service.check_slots``), so that the
    caller says it, rather than each replica failing at startup into Serve's controller log.

    The slots are those the replicas would start the service with (the options' service
    config, or ``CMX_BLOCK_BYTES``); a service already running with other slots is refused by
    each replica as it joins it (``service.check_slots`` there).
    """
    if options.engine.connector != "cmx":
        return
    from cmx.deploy.model import model_info
    from cmx.deploy.service import check_slots, service_config

    model = model_info(options.model, options.engine)
    check_slots(service_config(options, model).block_bytes, model)


def check_options(options: ServeOptions) -> None:
    """Every setting the application reads, checked before anything is deployed: its API key
    file (``KeyFileError``: missing, open to others, malformed) and its slots
    (``check_block_size``), here in the caller rather than in a replica."""
    from cmx.deploy.tenants import Tenancy

    Tenancy.load(options.engine.salt, options.tenants)
    if options.prefill_replicas < 0:
        raise CmxError(f"prefill_replicas must be >= 0, got {options.prefill_replicas}")
    if options.prefill_replicas and options.engine.connector != "cmx":
        raise CmxError("prefill replicas hand their prompts' KV to the decode replicas through "
                       "the context memory: they need engine.connector 'cmx', not "
                       f"{options.engine.connector!r}")
    check_block_size(options)


def build(options: ServeOptions) -> Any:
    """The bound application (pass it to ``serve.run``); refused as ``check_options`` says."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cmx.deploy.ingress import OpenAIIngress
    from cmx.deploy.server import LLMServer

    check_options(options)
    args = options.to_args()
    placement: dict[str, Any] = {}
    if options.max_replicas_per_node is not None:
        placement["max_replicas_per_node"] = options.max_replicas_per_node
    router_options: dict[str, Any] = {
        "request_router_class": ROUTER_CLASS, "request_router_kwargs": router_kwargs(options),
        "request_routing_stats_period_s": 2.0, "request_routing_stats_timeout_s": 5.0}
    router = RequestRouterConfig(**router_options)

    def replicas(name: str, count: int) -> Any:
        return serve.deployment(
            name=name, num_replicas=count, max_ongoing_requests=options.max_ongoing_requests,
            ray_actor_options={"num_cpus": options.replica_cpus,
                               "num_gpus": options.replica_gpus},
            request_router_config=router, health_check_timeout_s=120.0,
            # The replica's __del__ stops its engine (up to 5 s) and waits for its processes
            # to exit (up to server.ENGINE_EXIT_S) to reap their shared memory.
            graceful_shutdown_timeout_s=20.0, **placement,
        )(LLMServer)

    ingress = serve.deployment(
        name="OpenAIIngress", num_replicas=1, max_ongoing_requests=256,
        ray_actor_options={"num_cpus": 0},
    )(OpenAIIngress)
    if not options.prefill_replicas:
        return ingress.bind(replicas("LLMServer", options.replicas).bind(args), args)
    # Prefill and decode apart: prefill replicas load what is cached and store each prompt's
    # KV (kv_both), the decode replicas load it (kv_consumer), waiting for the store the
    # prefill names.
    prefill = replicas("LLMPrefill", options.prefill_replicas).bind(args, "kv_both")
    decode = replicas("LLMServer", options.replicas).bind(args, "kv_consumer")
    return ingress.bind(decode, args, prefill)


def build_app(args: dict[str, Any] | None = None) -> Any:
    """Application builder for Serve config files and ``serve run cmx.deploy.app:build_app``."""
    return build(ServeOptions.from_args(args))
