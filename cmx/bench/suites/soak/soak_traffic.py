"""The soak's requests: chat completions streamed through the OpenAI client at a steady rate,
greedy and sampled, two tenants, prompts sharing a system prompt and one of a few documents.

Every request is sent on a thread of its own from a pool, on a fixed schedule (an open loop: a
slow answer does not slow the next request down), and ends as one ``Outcome`` within the bound:
the client's read timeout is the bound, so no call outlives it by more than one read.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cmx.bench.suites.soak.soak_figures import Outcome, RequestRecord

__all__ = ["Prompt", "SoakTraffic", "ask", "make_prompts"]

_WORDS = ("tier", "block", "prefix", "replica", "lease", "shard", "agent", "arena", "segment",
          "journal", "checksum", "directory", "eviction", "prefetch", "slot", "commit")


@dataclass(frozen=True)
class Prompt:
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def make_prompts(seed: int, count: int, scale: float = 0.4) -> list[Prompt]:
    """``count`` questions about the demo workload's two documents, under its system prompt:
    every prompt shares the system prompt, and half of them each document."""
    from cmx.deploy.workload import make_workload

    work = make_workload(seed, scale)
    rng = random.Random(seed)
    out = []
    for i in range(count):
        doc = sorted(work.documents)[i % len(work.documents)]
        a, b = rng.sample(_WORDS, 2)
        question = f"({i}) Which {a} keeps the {b}, and why?"
        out.append(Prompt((("system", work.system),
                           ("user", f"Document {doc}:\n{work.documents[doc]}\n\n"
                                    f"Question: {question}"))))
    return out


def ask(client: Any, model: str, prompt: Prompt, max_tokens: int, bound_s: float,
        temperature: float = 0.0, seed: int | None = None,
        cache: bool = True) -> tuple[Outcome, float | None, float, str, str]:
    """One streamed chat completion: (outcome, ttft_s, total_s, text, error).

    The client raises its own errors until the response's head; a stream that breaks after it
    raises httpx's, as they come."""
    import httpx
    import openai

    t0 = time.monotonic()
    ttft: float | None = None
    parts: list[str] = []
    finished = False
    extra: dict[str, Any] = {} if cache else {"cache": False}
    try:
        stream = client.chat.completions.create(
            model=model, messages=prompt.as_messages(), max_tokens=max_tokens,
            temperature=temperature, seed=seed, stream=True, extra_body=extra)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    finished = True
    except openai.APITimeoutError as exc:
        return Outcome.HUNG, ttft, time.monotonic() - t0, "".join(parts), str(exc)
    except openai.APIStatusError as exc:
        return Outcome.FAILED, ttft, time.monotonic() - t0, "", f"{exc.status_code}: {exc}"
    except openai.APIError as exc:  # the connection failed or the stream carried an error
        return Outcome.FAILED, ttft, time.monotonic() - t0, "", f"{type(exc).__name__}: {exc}"
    except httpx.TimeoutException as exc:  # a read within the stream outlasted the bound
        return Outcome.HUNG, ttft, time.monotonic() - t0, "".join(parts), repr(exc)
    except httpx.HTTPError as exc:  # the stream broke after its head
        return Outcome.CUT, ttft, time.monotonic() - t0, "".join(parts), repr(exc)
    total = time.monotonic() - t0
    text = "".join(parts)
    if total > bound_s:
        return Outcome.HUNG, ttft, total, text, f"answered after {total:.0f} s"
    if not finished:
        return Outcome.CUT, ttft, total, text, "the stream ended without a finish reason"
    return Outcome.COMPLETED, ttft, total, text, ""


@dataclass(frozen=True)
class TrafficShape:
    rate: float  # requests per second
    greedy_share: float  # of the requests, temperature 0
    greedy_prompts: int  # the first this many prompts are the greedy ones
    max_tokens: int
    bound_s: float  # a request with no whole answer within this hung
    seed: int


class SoakTraffic:
    """Sends requests on a fixed schedule until ``stop``; ``records`` holds each one's outcome.

    ``clients`` maps a tenant to an OpenAI client carrying its API key.
    """

    def __init__(self, clients: dict[str, Any], model: str, prompts: list[Prompt],
                 shape: TrafficShape, log: Callable[[str], None]) -> None:
        self.clients = clients
        self.model = model
        self.prompts = prompts
        self.shape = shape
        self.log = log
        self.records: list[RequestRecord] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(8, int(shape.rate * shape.bound_s) + 8),
                                        thread_name_prefix="soak-request")
        self._pending: list[Future[None]] = []
        self._thread = threading.Thread(target=self._schedule, name="soak-schedule", daemon=True)
        self.started = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self._thread.start()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> None:
        """No more requests; wait for those in flight (each ends within the bound)."""
        self._stop.set()
        self._thread.join()
        for f in self._pending:
            f.result()
        self._pool.shutdown()

    def _schedule(self) -> None:
        rng = random.Random(self.shape.seed)
        tenants = sorted(self.clients)
        i = 0
        while not self._stop.wait(max(0.0, self.started + i / self.shape.rate
                                      - time.monotonic())):
            greedy = rng.random() < self.shape.greedy_share
            k = self.shape.greedy_prompts
            prompt = rng.randrange(k) if greedy else rng.randrange(k, len(self.prompts))
            tenant = tenants[i % len(tenants)]
            seed = None if greedy else rng.randrange(1 << 30)
            self._pending.append(self._pool.submit(self._one, tenant, greedy, prompt, seed))
            i += 1

    def _one(self, tenant: str, greedy: bool, prompt: int, seed: int | None) -> None:
        sent = self.elapsed()
        outcome, ttft, total, text, error = ask(
            self.clients[tenant], self.model, self.prompts[prompt], self.shape.max_tokens,
            self.shape.bound_s, temperature=0.0 if greedy else 0.8, seed=seed)
        record = RequestRecord(sent, tenant, greedy, prompt, outcome, ttft, total, text, error)
        if outcome is not Outcome.COMPLETED:
            self.log(f"request at {sent:.0f} s ({tenant}, prompt {prompt}): {outcome.value} "
                     f"after {total:.1f} s: {error[:200]}")
        with self._lock:
            self.records.append(record)
