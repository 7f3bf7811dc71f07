"""What a replica tells vLLM: the connector's settings (which CMXConnector must accept as they
are), the block size, and the ExampleConnector's shared directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from cmx.config import ServiceConfig
from cmx.connectors.settings import ConnectorSettings
from cmx.deploy.config import EngineOptions, ModelOptions, ServeOptions
from cmx.deploy.model import ModelInfo, namespace_digest
from cmx.deploy.vllm_engine import transfer_config
from cmx.keys import Namespace
from cmx.layout import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=32)
MODEL = ModelInfo("/models/m", "m", LAYOUT, "w" * 32, 49152, 2048)


def options(connector: str = "cmx") -> ServeOptions:
    return ServeOptions(model=ModelOptions(path="/models/m"),
                        engine=EngineOptions(block_size=32, connector=connector, gate=False))


def test_the_connector_accepts_the_settings_the_replica_gives_it() -> None:
    kv = transfer_config(options(), MODEL, ServiceConfig(block_bytes=LAYOUT.block_bytes),
                         "10.0.0.1:6379", "node-7")
    assert kv is not None
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == \
        ("CMXConnector", "cmx.connectors.vllm")
    assert kv["kv_role"] == "kv_both" and kv["kv_load_failure_policy"] == "recompute"
    settings = ConnectorSettings.from_extra(kv["kv_connector_extra_config"])
    assert (settings.model, settings.weights, settings.block_tokens) == ("m", "w" * 32, 32)
    assert settings.ray_address == "10.0.0.1:6379" and settings.node_id == "node-7"
    assert settings.service.block_bytes == LAYOUT.block_bytes and settings.gate is False
    assert settings.salt == ""  # tenants' salts come with each request as its cache_salt


def test_the_router_keys_are_the_connectors_namespace() -> None:
    # The connector names a request's namespace (model, layout, cache_salt, weights); the
    # ingress computes the router's keys from /cmx/info's fields and the tenant's salt.
    expected = Namespace("m", LAYOUT, "tenant-salt", "w" * 32).digest
    assert namespace_digest(MODEL.namespace(), "tenant-salt") == expected
    assert "salt" not in MODEL.namespace()


def test_no_connector_and_vllms_example_connector(tmp_path: Path) -> None:
    assert transfer_config(options("none"), MODEL, ServiceConfig()) is None
    example = transfer_config(options("example"), MODEL, ServiceConfig())
    assert example is not None and example["kv_connector"] == "ExampleConnector"
    path = example["kv_connector_extra_config"]["shared_storage_path"]
    again = transfer_config(options("example"), MODEL, ServiceConfig())
    assert again is not None  # every replica of one application shares the directory
    assert again["kv_connector_extra_config"]["shared_storage_path"] == path


def test_engine_options_refuse_what_vllm_on_cpu_cannot_run() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        EngineOptions(block_size=48)
    with pytest.raises(ValueError, match="connector"):
        EngineOptions(connector="lmcache")
