"""Between the context memory's KV tensor and transformers' ``DynamicCache``.

The memory's form is one tensor [layers, 2, kv_heads, tokens, head_dim]; a ``DynamicCache``
holds per layer a key and a value tensor [batch=1, kv_heads, tokens, head_dim].
"""

from __future__ import annotations

from typing import Any

__all__ = ["append_kv", "cache_tokens", "kv_slice", "new_cache", "snapshot"]


def new_cache(config: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=config)


def cache_tokens(cache: Any) -> int:
    return int(cache.get_seq_length())


def append_kv(cache: Any, kv: Any) -> None:
    """Append ``kv`` [layers, 2, kv_heads, n, head_dim] after the tokens ``cache`` holds."""
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)


def snapshot(cache: Any) -> list[tuple[Any, Any]]:
    """The per-layer (keys, values) tensors as they are now.

    ``DynamicCache.update`` concatenates into new tensors, so decoding later never changes
    these: a store can read them in the background while the replica decodes.
    """
    return [(layer.keys, layer.values) for layer in cache.layers]


def kv_slice(layers: list[tuple[Any, Any]], start: int, end: int) -> Any:
    """Tokens ``[start, end)`` of a snapshot as one [layers, 2, kv_heads, n, head_dim] tensor."""
    import torch

    return torch.stack([torch.stack((k[0, :, start:end], v[0, :, start:end]))
                        for k, v in layers]).contiguous()
