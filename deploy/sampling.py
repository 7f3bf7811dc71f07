"""Choosing the next token: greedy at temperature 0, else temperature and nucleus (top-p).

A request's ``seed`` seeds its own generator, so a sampled request is repeatable, and gives the
same tokens whether its prefix came from the cache or not (the logits are the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Sampler", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int | None = None  # None: a fresh seed per request

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """``allowed``: the token ids that may be chosen (None: all). The random model's vocabulary
    is larger than its byte tokenizer's; only ids the tokenizer can print are allowed."""

    def __init__(self, params: SamplingParams, allowed: Any = None) -> None:
        import torch

        self.params = params
        self.allowed = allowed  # a 1-D LongTensor of ids, or None
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def __call__(self, logits: Any) -> int:
        """One token id from the last position's logits (a 1-D float tensor)."""
        import torch

        if self.allowed is not None:
            masked = torch.full_like(logits, float("-inf"))
            masked[self.allowed] = logits[self.allowed]
            logits = masked
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < self.params.top_p
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=self.generator)
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=self.generator).item())
