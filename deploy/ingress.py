"""The OpenAI-compatible HTTP ingress: text in, token ids and block keys to a replica, JSON out.

    GET  /v1/models
    POST /v1/completions          (prompt: text or token ids)
    POST /v1/chat/completions     (messages, through the tokenizer's chat template)
    GET  /cmx/info                the namespace the replicas share (model, weights, layout)
    GET  /cmx/replicas            the replicas the router knows, with their nodes

The ingress tokenizes and computes the prompt's block keys (the namespace comes from a replica,
which fingerprinted the weights it loaded), so the router can ask the directory where the
prefix is before any replica sees the request.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the route handlers' annotations
# at runtime, through Serve's ingress wrapper, and cannot resolve postponed ones there.

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from ray import serve

from cmx.deploy.config import ServeOptions
from cmx.deploy.messages import GenerateRequest, ReplicaInfo
from cmx.deploy.model import make_tokenizer
from cmx.deploy.openai_types import (
    ChatRequest,
    CompletionRequest,
    chat_body,
    completion_body,
    models_body,
)
from cmx.deploy.routing import known_replicas
from cmx.deploy.sampling import SamplingParams
from cmx.deploy.tokenizer import Message

__all__ = ["OpenAIIngress", "app"]

app = FastAPI(title="CMX on Ray: an OpenAI-compatible LLM with cluster-wide prefix caching")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


@app.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return _error(exc.status, exc.message, exc.kind)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """The body as ``model``, its errors in OpenAI's error format."""
    try:
        return model.model_validate(await request.json())
    except ValidationError as exc:
        raise ApiError(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                      for e in exc.errors())) from None
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, llm: Any, args: dict[str, Any]) -> None:
        self.options = ServeOptions.from_args(args)
        self.llm = llm
        self.tokenizer = make_tokenizer(self.options.model)
        self.model_id = self.options.model.model_id
        self._info: ReplicaInfo | None = None
        self._digest = b""

    async def _namespace(self) -> tuple[ReplicaInfo, bytes]:
        if self._info is None:
            from cmx.keys import Namespace
            from cmx.layout import KVLayout

            info: ReplicaInfo = await self.llm.info.remote()
            ns = dict(info.namespace)
            layout = KVLayout(ns["num_layers"], ns["num_kv_heads"], ns["head_dim"],  # type: ignore[arg-type]
                              ns["dtype"], ns["block_tokens"])  # type: ignore[arg-type]
            self._digest = Namespace(str(ns["model"]), layout, str(ns["salt"]),
                                     str(ns["weights"])).digest
            self._info = info
        return self._info, self._digest

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise ApiError(404, f"model {model!r} does not exist; this server has "
                                f"{self.model_id!r}", "not_found_error")

    async def _generate(self, body: Any, prompt_ids: list[int], max_tokens: int) -> Any:
        if body.stream:
            raise ApiError(400, "streaming is not supported; send stream=false")
        if body.n != 1:
            raise ApiError(400, "n must be 1")
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty")
        limit = self.options.engine.max_tokens_limit
        if max_tokens > limit:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's {limit}")
        info, digest = await self._namespace()
        from cmx.keys import chain_keys

        keys = tuple(chain_keys(digest, prompt_ids, info.block_tokens)) if body.cache else ()
        req = GenerateRequest(
            request_id=uuid.uuid4().hex, prompt_ids=tuple(prompt_ids), max_tokens=max_tokens,
            sampling=SamplingParams(body.temperature, body.top_p, body.seed),
            stop=body.stops(), use_cache=body.cache, ignore_eos=body.ignore_eos, keys=keys,
            replica=body.replica,
        )
        return await self.llm.generate.remote(req)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return models_body(self.model_id)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> dict[str, Any]:
        t0 = time.perf_counter()
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        result = await self._generate(body, ids, body.max_tokens or 16)
        return completion_body(result, self.model_id, time.perf_counter() - t0)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> dict[str, Any]:
        t0 = time.perf_counter()
        body = await _parse(request, ChatRequest)
        self._check_model(body.model)
        roles = {"developer": "system"}
        messages = [Message(roles.get(m.role, m.role), m.text()) for m in body.messages]
        result = await self._generate(body, self.tokenizer.chat(messages), body.limit())
        return chat_body(result, self.model_id, time.perf_counter() - t0)

    @app.get("/cmx/info")
    async def info(self) -> dict[str, Any]:
        info, digest = await self._namespace()
        return {"model": self.model_id, "namespace": info.namespace,
                "namespace_id": digest[:8].hex(), "block_tokens": info.block_tokens,
                "chunk_tokens": info.chunk_tokens, "cache": info.cache}

    @app.get("/cmx/replicas")
    async def replicas(self) -> dict[str, Any]:
        await self._namespace()  # a first call through the handle starts its router
        return {"replicas": known_replicas("LLMServer")}
