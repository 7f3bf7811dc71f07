"""The OpenAI-compatible HTTP ingress: text in, token ids and block keys to a replica, JSON or
server-sent events out.

    GET  /v1/models
    POST /v1/completions          (prompt: text or token ids)
    POST /v1/chat/completions     (messages, through the model's own chat template)
    GET  /cmx/info                the model, its layout and limits (never a tenant's salt)
    GET  /cmx/replicas            the replicas the router knows, with their nodes

The ingress checks every request against the served model (token ids inside the vocabulary,
prompt plus completion inside the context length) and answers a malformed one with an
OpenAI-style 4xx error object. A text prompt or chat of over 64 characters per token of the
context is refused before it is tokenized, and token ids past the context length before they
are scanned; decoding a body (JSON and its validation) and tokenizing run on threads of their
own, so the event loop serves other requests meanwhile. A route that runs a prompt first checks
the API key (``auth``: a 401 for a key the deployment's key file lacks) and derives the tenant's
namespace salt (``tenants``); the ingress computes the prompt's block keys in that namespace,
so the router asks the directory where the prefix is before any replica sees the request.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route handlers' annotations
# at runtime, through Serve's ingress wrapper, and cannot resolve postponed ones there.

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from cmx.deploy.auth import AUTHENTICATED, request_salt
from cmx.deploy.config import ServeOptions
from cmx.deploy.errors import ApiError, install_handlers, parse_body
from cmx.deploy.messages import GenerateRequest, ReplicaInfo, Sampling, Summary
from cmx.deploy.openai_bodies import Kind, Reply, models_body, sse
from cmx.deploy.openai_types import ChatRequest, CompletionRequest
from cmx.deploy.routing import known_replicas
from cmx.deploy.tenants import Tenancy

log = logging.getLogger(__name__)

__all__ = ["PARSE_THREADS", "OpenAIIngress", "app"]

# Bodies decoded at once: more would not go faster (the GIL) and would hold more memory, each
# 8 MiB body of token ids decoding to ~4M Python ints.
PARSE_THREADS = 2

app = FastAPI(title="CMX on Ray: an OpenAI-compatible LLM with cluster-wide prefix caching")
install_handlers(app)


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, llm: Any, args: dict[str, Any], prefill: Any = None) -> None:
        from cmx.deploy.model import load_tokenizer

        self.options = ServeOptions.from_args(args)
        self.tenancy = Tenancy.load(self.options.engine.salt, self.options.tenants)  # auth
        self.llm = llm
        self.prefill = prefill  # replicas that compute prompts only (``prefill_replicas``)
        self.tokenizer = load_tokenizer(self.options.model)
        # Tokenizing runs on this one thread, never on the event loop, which serves every other
        # request meanwhile; one thread, as a Hugging Face tokenizer is not made to be called
        # from several at once.
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="cmx-tokenize")
        self._parsing = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="cmx-parse")
        self.model_id = self.options.model.model_id
        self._info: ReplicaInfo | None = None

    async def _replica_info(self) -> ReplicaInfo:
        if self._info is None:
            self._info = await self.llm.info.remote()
        return self._info

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise ApiError(404, f"the model {model!r} does not exist; this server has "
                                f"{self.model_id!r}", "not_found_error", "model")

    async def _request(self, request: Request, body: Any, ids: list[int],
                       max_tokens: int | None) -> GenerateRequest:
        info = await self._replica_info()
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        # The length first: the scan below then reads at most one context's ids.
        room = info.max_model_len - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise ApiError(400, f"this model's maximum context length is {info.max_model_len} "
                                f"tokens; the prompt has {len(ids)} and asks for "
                                f"{max_tokens or 1} more", param="max_tokens")
        bad = next((i for i in ids if i >= info.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary "
                                f"(0..{info.vocab_size - 1})", param="prompt")
        salt = request_salt(request, body.cache_salt)
        keys = self._keys(info, salt, ids) if body.cache else ()
        sampling = Sampling(max_tokens=max_tokens or room, temperature=body.temperature,
                            top_p=body.top_p, seed=body.seed, n=body.n, stop=body.stops(),
                            ignore_eos=body.ignore_eos)
        return GenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=tuple(ids),
                               sampling=sampling, salt=salt, use_cache=body.cache, keys=keys,
                               replica=body.replica)

    @staticmethod
    def _keys(info: ReplicaInfo, salt: str, ids: list[int]) -> tuple[bytes, ...]:
        from cmx.deploy.model import namespace_digest
        from cmx.keys import chain_keys

        digest = namespace_digest(info.namespace, salt)
        return tuple(chain_keys(digest, ids, info.block_tokens))

    async def _answer(self, kind: Kind, body: Any, req: GenerateRequest) -> Any:
        req = await self._prefilled(req)
        reply = Reply(kind, self.model_id, req.sampling.n)
        stream = self.llm.options(stream=True).generate.remote(req)
        if body.stream:
            return StreamingResponse(self._events(reply, stream, body.include_usage),
                                     media_type="text/event-stream")
        async for item in stream:
            if isinstance(item, Summary):
                reply.summary = item
            else:
                for delta in item:
                    reply.add(delta)
        return JSONResponse(reply.body())

    async def _prefilled(self, req: GenerateRequest) -> GenerateRequest:
        """With prefill replicas, the prompt is computed on one of them first (one token, its
        KV stored), and the decode replica is told how many of its tokens to wait for. A
        prefill that fails leaves the decode replica to compute the prompt itself."""
        if self.prefill is None or not req.use_cache:
            return req
        one = dataclasses.replace(req.sampling, max_tokens=1, n=1)
        first = dataclasses.replace(req, request_id=f"{req.request_id}-prefill", sampling=one,
                                    replica=None)
        expect = 0
        try:
            async with asyncio.timeout(self.options.prefill_timeout_s):
                async for item in self.prefill.options(stream=True).generate.remote(first):
                    if isinstance(item, Summary):
                        expect = int(item.memory.get("expect_tokens", 0) or 0)
        except Exception as exc:  # noqa: BLE001 - the decode replica computes the prompt
            log.warning("prefill of request %s failed or was late: %r", req.request_id, exc)
        return dataclasses.replace(req, expect_tokens=expect)

    async def _events(self, reply: Reply, stream: Any, usage: bool) -> AsyncIterator[str]:
        async for item in stream:
            if isinstance(item, Summary):
                reply.summary = item
            elif item:
                for delta in item:
                    reply.add(delta)
                yield sse(reply.chunk(item))
        if usage:
            yield sse(reply.usage_chunk())
        yield sse("[DONE]")

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        info = await self._replica_info()
        return models_body(self.model_id, info.max_model_len)

    @app.post("/v1/completions", dependencies=[AUTHENTICATED])
    async def completions(self, request: Request) -> Any:
        body = await parse_body(request, CompletionRequest, self._parsing)
        self._check_model(body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "the prompt has", "prompt")
            ids = await self._tokenize(self.tokenizer.encode, prompt)
        else:
            ids = prompt  # not copied on the loop: up to ~4M ids before the length check
        req = await self._request(request, body, ids, body.max_tokens)
        return await self._answer("completion", body, req)

    @app.post("/v1/chat/completions", dependencies=[AUTHENTICATED])
    async def chat(self, request: Request) -> Any:
        body = await parse_body(request, ChatRequest, self._parsing)
        self._check_model(body.model)
        messages = body.as_dicts()
        self._check_chars(sum(len(m["content"]) for m in messages), "the messages have",
                          "messages")
        try:
            ids = await self._tokenize(self.tokenizer.chat, messages)
        except ValueError as exc:
            raise ApiError(400, f"the chat template refused the messages: {exc}",
                           param="messages") from None
        req = await self._request(request, body, ids, body.limit())
        return await self._answer("chat", body, req)

    def _check_chars(self, chars: int, subject: str, param: str) -> None:
        # A text far longer than any context is refused before it is tokenized.
        limit = 64 * self.options.engine.max_model_len
        if chars > limit:
            raise ApiError(400, f"{subject} {chars} characters; at most {limit}", param=param)

    async def _tokenize(self, tokenize: Callable[[Any], list[int]], text: Any) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, tokenize, text)

    @app.get("/cmx/info")
    async def info(self) -> dict[str, Any]:
        info = await self._replica_info()
        return {"model": self.model_id, "namespace": info.namespace,
                "block_tokens": info.block_tokens, "max_model_len": info.max_model_len,
                "vocab_size": info.vocab_size, "cache": info.cache}

    @app.get("/cmx/replicas")
    async def replicas(self) -> dict[str, Any]:
        await self._replica_info()  # a first call through the handle starts its router
        return {"replicas": known_replicas("LLMServer")}
