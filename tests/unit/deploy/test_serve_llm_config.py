"""``deploy/serve_llm_config.yaml``, Ray Serve LLM's config: Serve's schema accepts it, its args
are ``ServeOptions``, and the ``LLMConfig`` they build fits two cores and passes the connector's
startup checks (the engine's block size is the connector's; the service it would start has
slots of one block). The packaged SmolLM2 is read for its layout; no Ray runs here."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
import yaml

from cmx.deploy.config import ServeOptions

UNREACHABLE = "192.0.2.1:6379"  # TEST-NET-1: nothing is asked of it here
CORES = 2  # what the file is sized for


def shipped() -> tuple[Any, ServeOptions]:
    from ray.serve.schema import ServeDeploySchema

    text = resources.files("cmx.deploy").joinpath("serve_llm_config.yaml").read_text()
    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(text)).applications
    return app, ServeOptions.from_args(app.args)  # every arg is an option


def test_the_file_names_the_serve_llm_builder_with_two_replicas() -> None:
    app, options = shipped()
    assert app.import_path == "cmx.deploy.serve_llm:build_app"
    assert options.replicas == 2 and options.engine.connector == "cmx"
    assert ServeOptions.from_args(options.to_args()) == options


def test_its_llm_config_fits_two_cores_and_passes_the_connectors_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cmx.deploy.model import model_info
    from cmx.deploy.serve_llm import llm_config
    from cmx.deploy.serve_llm_server import CMXLLMServer
    from cmx.deploy.service import check_slots

    monkeypatch.delenv("CMX_BLOCK_BYTES", raising=False)  # as an operator's shell has it
    _, options = shipped()
    config = llm_config(options, UNREACHABLE)
    assert config.server_cls is CMXLLMServer

    replicas = config.deployment_config["num_replicas"]
    actor_cpus = config.deployment_config["ray_actor_options"]["num_cpus"]
    bundle_cpus = sum(b.get("CPU", 0) for b in config.placement_group_config["bundles"])
    assert replicas * (actor_cpus + bundle_cpus) <= CORES
    env = config.runtime_env["env_vars"]
    assert replicas * int(env["OMP_NUM_THREADS"]) <= CORES
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1  # GiB, an integer

    extra = config.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["block_tokens"] == config.engine_kwargs["block_size"]
    model = model_info(options.model, options.engine)
    assert model.layout.block_tokens == config.engine_kwargs["block_size"]
    check_slots(extra["service"]["block_bytes"], model)  # raises where a block does not fit


def test_its_llm_config_refuses_gpus_its_cpu_engines_would_leave_idle() -> None:
    from cmx.deploy.config import SettingsError
    from cmx.deploy.serve_llm import llm_config

    _, options = shipped()
    with pytest.raises(SettingsError, match="replica_gpus"):
        llm_config(options.replace(replica_gpus=1), UNREACHABLE)
