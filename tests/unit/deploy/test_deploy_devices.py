"""A replica's engine settings follow what its node has (``engine_settings``): vLLM's CUDA
defaults where torch sees a GPU, vLLM's CPU backend where it sees none, and a refusal where Ray
gave the replica a GPU that torch cannot see. Nodes are described, not run on: each branch is
taken on any machine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from cmx.deploy.config import EngineOptions, ModelOptions, ServeOptions
from cmx.deploy.devices import Accelerator, DeviceMismatch, NodeDevices
from cmx.deploy.model import ModelInfo
from cmx.deploy.vllm_engine import build_engine, engine_settings
from cmx.layout import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=32)
MODEL = ModelInfo("/models/m", "m", LAYOUT, "w" * 32, 49152, 2048)
OPTIONS = ServeOptions(model=ModelOptions(path="/models/m"),
                       engine=EngineOptions(block_size=32, kv_cache_gib=3, threads=4))
GPU_HOST = NodeDevices(cuda_devices=1, ray_gpus=1)  # a replica_gpus=1 replica on a GPU host
CPU_HOST = NodeDevices(cuda_devices=0, ray_gpus=0)
CPU_BACKEND = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")
ALL_SET = (*CPU_BACKEND, "VLLM_NO_USAGE_STATS", "VLLM_LOGGING_LEVEL",
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


def environment(settings: Any, before: dict[str, str]) -> dict[str, str]:
    env = dict(before)
    settings.apply(env)
    return env


def test_a_gpu_node_gets_vllms_cuda_defaults_and_none_of_the_cpu_backends_settings() -> None:
    settings = engine_settings(OPTIONS, GPU_HOST)
    assert settings.accelerator is Accelerator.CUDA
    assert settings.enforce_eager is False  # CUDA graphs, vLLM's default
    env = environment(settings, {"OMP_NUM_THREADS": "1"})  # as Ray's workers have it
    assert not [name for name in CPU_BACKEND if name in {**settings.env, **settings.env_defaults}]
    assert env["OMP_NUM_THREADS"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in env
    # Ray leaves every GPU visible to a replica that reserved none: torch's view decides.
    assert engine_settings(OPTIONS, NodeDevices(cuda_devices=2)) == settings


def test_a_cpu_node_keeps_the_cpu_backends_settings() -> None:
    settings = engine_settings(OPTIONS, CPU_HOST)
    assert settings.accelerator is Accelerator.CPU
    assert settings.enforce_eager is True
    env = environment(settings, {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"  # GiB, engine.kv_cache_gib
    assert env["OMP_NUM_THREADS"] == "4"  # engine.threads, over Ray's
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"  # an operator's setting stays
    assert env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"


def test_a_gpu_that_torch_cannot_see_is_refused() -> None:
    # The CPU image on a GPU host: its torch has no CUDA, and the engine would run on the CPU.
    with pytest.raises(DeviceMismatch, match="Dockerfile.gpu"):
        engine_settings(OPTIONS, NodeDevices(cuda_devices=0, ray_gpus=1))


def test_this_process_is_described_without_ray() -> None:
    import torch

    node = NodeDevices.here()
    assert node == NodeDevices(cuda_devices=torch.cuda.device_count(), ray_gpus=0)
    expected = Accelerator.CUDA if node.cuda_devices else Accelerator.CPU
    assert engine_settings(OPTIONS, node).accelerator is expected
    with pytest.raises(ValueError, match="negative"):
        NodeDevices(cuda_devices=-1)


@pytest.fixture()
def engine_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The variables an engine's settings set, unset now and as they were afterwards."""
    for name in ALL_SET:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield


@pytest.mark.parametrize(("node", "eager", "cpu_env"), [(GPU_HOST, False, False),
                                                          (CPU_HOST, True, True)],
                         ids=["gpu", "cpu"])
def test_a_replica_starts_its_engine_as_its_node_says(
    node: NodeDevices, eager: bool, cpu_env: bool, engine_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async_llm = pytest.importorskip("vllm.v1.engine.async_llm")

    class RecordingLLM(async_llm.AsyncLLM):
        """vLLM's AsyncLLM that records the arguments it was made from and starts nothing."""

        made: list[Any] = []

        @classmethod
        def from_engine_args(cls, engine_args: Any, *args: Any, **kwargs: Any) -> Any:
            cls.made.append(engine_args)
            return cls.__new__(cls)

        def shutdown(self, timeout: float | None = None) -> None:
            pass  # no engine was started

    monkeypatch.setattr(async_llm, "AsyncLLM", RecordingLLM)
    engine = build_engine(OPTIONS, MODEL, None, node)
    assert isinstance(engine, RecordingLLM)
    (args,) = RecordingLLM.made
    assert args.enforce_eager is eager and args.dtype == OPTIONS.engine.dtype
    assert ("VLLM_CPU_KVCACHE_SPACE" in os.environ) is cpu_env
    assert os.environ["OMP_NUM_THREADS"] == ("4" if cpu_env else "1")
