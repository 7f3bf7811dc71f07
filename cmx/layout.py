"""KVLayout: the geometry of a model's KV cache and the byte layout of one block's payload.

A block holds ``block_tokens`` tokens of every layer's K and V. Its payload is one contiguous
buffer. Two orders are offered:

- ``LAYER_MAJOR`` (default): [layer, k/v, head, token, dim]. A layer range, or a head range
  within one layer, is a few contiguous runs; layer-by-layer loading reads a prefix of the block.
- ``HEAD_MAJOR``: [head, layer, k/v, token, dim]. One KV head across all layers is a single
  contiguous run: what head-wise attention (HEADINFER) loads.

The tensor form the client sees is always [layers, 2, kv_heads, tokens, head_dim].
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cmx.errors import LayoutMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["KVLayout", "PayloadOrder", "DTYPE_BYTES"]

DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class PayloadOrder(str, enum.Enum):
    LAYER_MAJOR = "layer_major"
    HEAD_MAJOR = "head_major"


@dataclass(frozen=True)
class KVLayout:
    num_layers: int  # transformer layers that keep a KV cache
    num_kv_heads: int  # KV heads per layer (after GQA grouping)
    head_dim: int  # elements per head vector
    dtype: str = "bfloat16"  # element type; one of DTYPE_BYTES
    block_tokens: int = 256  # tokens per block; only full blocks are stored
    order: PayloadOrder = PayloadOrder.LAYER_MAJOR  # byte order of a block's payload

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise LayoutMismatchError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutMismatchError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        object.__setattr__(self, "order", PayloadOrder(self.order))

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token across all layers, K and V, all heads."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_tokens

    @property
    def head_run_bytes(self) -> int:
        """Bytes of one head's K (or V) for one layer and all tokens of a block."""
        return self.block_tokens * self.head_dim * self.itemsize

    def shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Tensor shape of ``tokens`` tokens: [layers, 2, kv_heads, tokens, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, tokens, self.head_dim)

    @property
    def payload_shape(self) -> tuple[int, ...]:
        L, H, T, D = self.num_layers, self.num_kv_heads, self.block_tokens, self.head_dim
        if self.order is PayloadOrder.LAYER_MAJOR:
            return (L, 2, H, T, D)
        return (H, L, 2, T, D)

    def describe(self) -> bytes:
        """A canonical byte string of the geometry, for namespace digests."""
        return (
            f"L={self.num_layers};H={self.num_kv_heads};D={self.head_dim};"
            f"dtype={self.dtype};T={self.block_tokens};order={self.order.value}"
        ).encode()

    # -- slices --------------------------------------------------------------------------------

    def slice_runs(
        self, layers: range | None = None, heads: range | None = None
    ) -> list[tuple[int, int]]:
        """Contiguous (offset, length) runs of a block payload holding ``layers`` x ``heads``.

        All tokens of the block, K and V both. Adjacent runs are merged, so a full range gives
        one run of ``block_bytes``.
        """
        layers = self._check_range(layers, self.num_layers, "layers")
        heads = self._check_range(heads, self.num_kv_heads, "heads")
        run = self.head_run_bytes
        runs: list[tuple[int, int]] = []
        if self.order is PayloadOrder.LAYER_MAJOR:
            for layer in layers:
                for kv in (0, 1):
                    base = ((layer * 2 + kv) * self.num_kv_heads + heads.start) * run
                    runs.append((base, len(heads) * run))
        else:
            per_head = self.num_layers * 2 * run
            for head in heads:
                runs.append((head * per_head + layers.start * 2 * run, len(layers) * 2 * run))
        return _merge_runs(runs)

    @staticmethod
    def _check_range(r: range | None, n: int, name: str) -> range:
        if r is None:
            return range(n)
        if r.step != 1 or len(r) == 0 or r.start < 0 or r.stop > n:
            raise LayoutMismatchError(f"{name} range {r} is not a non-empty slice of 0..{n}")
        return r

    # -- tensors -------------------------------------------------------------------------------

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def check_kv(self, kv: torch.Tensor, tokens: int | None = None) -> None:
        """Raise LayoutMismatchError unless ``kv`` is [layers, 2, kv_heads, tokens, head_dim]."""
        import torch

        if not isinstance(kv, torch.Tensor):
            raise LayoutMismatchError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dtype != self.torch_dtype():
            raise LayoutMismatchError(f"kv dtype {kv.dtype} != layout dtype {self.dtype}")
        n = kv.shape[3] if kv.dim() == 5 else -1
        expected = self.shape(tokens if tokens is not None else n)
        if tuple(kv.shape) != expected:
            raise LayoutMismatchError(
                f"kv shape {tuple(kv.shape)} != [layers, 2, kv_heads, tokens, head_dim] {expected}"
            )

    def to_payload(self, kv_block: torch.Tensor) -> torch.Tensor:
        """One block's [L, 2, H, T, D] tensor as its contiguous payload (a flat uint8 tensor)."""
        import torch

        self.check_kv(kv_block, self.block_tokens)
        t = kv_block if self.order is PayloadOrder.LAYER_MAJOR else kv_block.permute(2, 0, 1, 3, 4)
        return t.contiguous().reshape(-1).view(torch.uint8)

    def from_payload(self, payload: object) -> torch.Tensor:
        """The [L, 2, H, T, D] tensor of one block's payload (a view where the order allows)."""
        import torch

        from cmx.buffers import as_bytes_view

        raw = as_bytes_view(payload)
        if raw.nbytes != self.block_bytes:
            raise LayoutMismatchError(f"payload is {raw.nbytes} bytes, block is {self.block_bytes}")
        t = torch.from_numpy(raw).view(self.torch_dtype()).reshape(self.payload_shape)
        if self.order is PayloadOrder.HEAD_MAJOR:
            t = t.permute(1, 2, 0, 3, 4)
        return t

    def split_blocks(self, kv: torch.Tensor) -> list[torch.Tensor]:
        """Payloads of the full blocks of ``kv`` [L, 2, H, N, D]; a partial tail is dropped."""
        self.check_kv(kv)
        n_blocks = kv.shape[3] // self.block_tokens
        T = self.block_tokens
        return [self.to_payload(kv[:, :, :, i * T : (i + 1) * T]) for i in range(n_blocks)]

    def join_blocks(self, payloads: list[object]) -> torch.Tensor:
        """The [L, 2, H, n*T, D] tensor of consecutive block payloads."""
        import torch

        if not payloads:
            return torch.empty(self.shape(0), dtype=self.torch_dtype())
        return torch.cat([self.from_payload(p) for p in payloads], dim=3)

    def random_kv(self, tokens: int, seed: int = 0) -> torch.Tensor:
        """Deterministic random KV of ``tokens`` tokens, for tests, demos and benchmarks."""
        import torch

        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.shape(tokens), generator=g, dtype=torch.float32)
        return x.to(self.torch_dtype())


def _merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for off, length in sorted(runs):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((off, length))
    return merged
