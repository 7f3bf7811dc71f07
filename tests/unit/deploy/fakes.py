"""In-process fakes of the context memory for engine tests (subclasses of the real interface)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cmx.deploy.config import EngineOptions, ModelOptions
from cmx.deploy.memory import Found, KVMemory
from cmx.keys import chain_keys
from cmx.layout import KVLayout

# 2 layers x 2 (K,V) x 1 KV head x 16 dim x 4 bytes = 256 bytes per token.
TINY = ModelOptions(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=1, vocab_size=512, max_positions=4096, seed=7)
TINY_ENGINE = EngineOptions(block_tokens=16, chunk_tokens=32, warmup_tokens=64)


class DictMemory(KVMemory):
    """Blocks in a dict; every block reports ``source`` as where it would come from."""

    def __init__(self, layout: KVLayout, digest: bytes = b"ns", source: str = "dram",
                 node: str = "node-a", load_delay_s: float = 0.0) -> None:
        self.layout = layout
        self.block_tokens = layout.block_tokens
        self.digest = digest
        self.source = source
        self.node = node
        self.load_delay_s = load_delay_s
        self.blocks: dict[bytes, Any] = {}
        self.loads = 0
        self.stores: list[tuple[int, int]] = []  # (start, end) tokens of each store

    def _keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return chain_keys(self.digest, list(token_ids), self.block_tokens)

    def lookup(self, token_ids: Sequence[int]) -> Found:
        n = 0
        for key in self._keys(token_ids):
            if key not in self.blocks:
                break
            n += 1
        return Found(self.block_tokens, (self.source,) * n, (self.layout.block_bytes,) * n)

    def load(self, token_ids: Sequence[int], found: Found, n_tokens: int) -> Any:
        import torch

        self.loads += 1
        time.sleep(self.load_delay_s)
        keys = self._keys(token_ids)[: n_tokens // self.block_tokens]
        parts = [self.blocks[k] for k in keys if k in self.blocks]
        return torch.cat(parts, dim=3) if parts else None

    def store(self, token_ids: Sequence[int], kv: Any, start: int) -> None:
        keys = self._keys(token_ids)
        T = self.block_tokens
        for i in range(start // T, len(keys)):
            off = i * T - start
            self.blocks.setdefault(keys[i], kv[:, :, :, off : off + T].clone())
        self.stores.append((start, len(keys) * T))

    def prefetch(self, token_ids: Sequence[int]) -> None:
        return None
