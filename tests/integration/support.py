"""Shared pieces of the integration tests: the layout, and a client on a chosen node."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cmx import ContextMemory, KVLayout
from cmx.config import ServiceConfig

# 4 layers x 2 (K,V) x 2 heads x 16 tokens x 64 dim x 2 bytes = 32 KiB blocks.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
BLOCK = LAYOUT.block_bytes


class RemoteClient:
    def __init__(self, config: ServiceConfig) -> None:
        self.cm = ContextMemory.connect(config=config, start_service=False)

    def node(self) -> str:
        return self.cm.node_id

    def store(self, model: str, layout: KVLayout, salt: str, tokens: Any, kv: Any) -> int:
        return self.cm.namespace(model, layout, salt).store(tokens, kv).wait()

    def lookup(self, model: str, layout: KVLayout, salt: str, tokens: Any) -> list[tuple]:
        match = self.cm.namespace(model, layout, salt).lookup(tokens)
        return [(b.tier.value, b.node) for b in match.blocks]

    def load(self, model: str, layout: KVLayout, salt: str, tokens: Any) -> Any:
        return self.cm.namespace(model, layout, salt).load(tokens)


def client_on(node_id: str, config: ServiceConfig) -> Any:
    return ray.remote(RemoteClient).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    ).remote(config)
