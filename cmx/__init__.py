"""CMX on Ray: a context memory service for LLM KV cache across HBM, DRAM and NVMe tiers."""

from __future__ import annotations

from cmx.errors import (
    BlockTooLargeError,
    CmxError,
    InvalidKeyError,
    LayoutMismatchError,
    StoreFullError,
)
from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.layout import KVLayout, PayloadOrder

__all__ = [
    "BlockHash",
    "ContextMemory",
    "BlockTooLargeError",
    "CmxError",
    "InvalidKeyError",
    "KVLayout",
    "LayoutMismatchError",
    "Namespace",
    "PayloadOrder",
    "StoreFullError",
    "chain_keys",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The client pulls in Ray; load it only when asked for, so the block model stays light.
    if name == "ContextMemory":
        from cmx.client import ContextMemory

        return ContextMemory
    raise AttributeError(f"module 'cmx' has no attribute {name!r}")
