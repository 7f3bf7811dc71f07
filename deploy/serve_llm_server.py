"""``CMXLLMServer``: Ray Serve LLM's replica (``ray.serve.llm``'s ``LLMServer``) with what a
replica of the context memory needs beside it; ``cmx.deploy.serve_llm`` names it as the
``server_cls`` of its ``LLMConfig``.

- **Its engine's shared memory is reaped when it stops.** Ray Serve LLM's replica never stops
  its vLLM engine (``VLLMEngine.shutdown`` closes a socket only): Serve kills the replica, Ray
  kills the engine's processes with it, and the ``psm_*`` segments they talk through (about
  400 MiB per engine) stay in /dev/shm until reboot. This replica records the segments its
  engine's processes hold once the engine is up (``EngineSegments``, as ``cmx.deploy.server``
  does); when Serve stops it (``__del__``) it stops the engine, waits a bounded while for its
  processes to exit and unlinks what they left. Killed instead (a replica killed, ``serve
  run`` stopped by a signal: Ray tears its cluster down without stopping Serve), it runs no
  code: the sentinel it left when it recorded (``EngineSegments.watch``) unlinks what the
  engine left once the replica and the engine's processes are gone. Starting, it unlinks what
  engines of earlier replicas on this host left.
- **It names itself in each whole response** (streamed ones are left as they are):
  ``kv_transfer_params["cmx"]`` carries ``replica`` (Serve's replica id) and ``node`` (Ray's
  node id) beside the connector's figures, as the application's ``cmx`` extension does, so a
  client sees which replica loaded or computed a prefix.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

from ray.serve.llm import LLMServer

from cmx.operate.orphans import EngineSegments

__all__ = ["ENGINE_EXIT_S", "CMXLLMServer", "EngineMemory"]

log = logging.getLogger(__name__)

ENGINE_EXIT_S = 8.0  # how long a stopping replica waits for its engine's processes to exit


class EngineMemory:
    """The shared memory of one replica's engine, in call order: built before the engine
    starts (unlinks what stopped engines on this host left), ``started`` once it is up
    (records the segments its processes hold, and leaves a sentinel to unlink them should the
    replica be killed), ``stopped`` once it was told to stop (waits up to ``ENGINE_EXIT_S``
    for them to exit, then unlinks what they left)."""

    def __init__(self) -> None:
        self.segments = EngineSegments.default()
        self.record: str | None = None
        self._reap(0.0)

    def started(self) -> None:
        import psutil

        # The replica's descendants: vLLM's engine core and its workers (and multiprocessing's
        # resource tracker, which holds no segment and so is no part of the record).
        pids = [p.pid for p in psutil.Process().children(recursive=True)]
        try:
            self.record = self.segments.record(pids)
        except OSError as exc:  # no record: what the engine leaves is not reaped
            log.warning("the engine's shared memory was not recorded: %s", exc)
        # Killed (Serve's kill, a node or the whole cluster torn down), the replica reaps
        # nothing: a sentinel does, once the replica and its engine are gone.
        if self.record is not None and not self.segments.watch(self.record):
            log.warning("no sentinel watches the engine's shared memory: killed, this replica "
                        "leaves it to the next one to start here")

    def stopped(self) -> None:
        self._reap(ENGINE_EXIT_S if self.record is not None else 0.0)

    def _reap(self, wait_s: float) -> None:
        try:
            self.segments.reap(wait_s=wait_s, wait_for=self.record)
        except OSError as exc:
            log.warning("stopped engines' shared memory was not reaped: %s", exc)


class CMXLLMServer(LLMServer):
    """``LLMServer`` whose engine's shared memory is reaped, naming itself in its responses."""

    async def start(self) -> None:
        import ray
        from ray import serve

        self._memory = EngineMemory()
        await super().start()
        self._memory.started()
        self._identity = {"replica": serve.get_replica_context().replica_id.unique_id,
                          "node": ray.get_runtime_context().get_node_id()}

    async def completions(self, request: Any, raw_request_info: Any = None
                          ) -> AsyncGenerator[Any, None]:
        return self._named(await super().completions(request, raw_request_info))

    async def chat(self, request: Any, raw_request_info: Any = None
                   ) -> AsyncGenerator[Any, None]:
        return self._named(await super().chat(request, raw_request_info))

    async def _named(self, stream: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        async for item in stream:
            # A whole response is one object; a stream's are lists of encoded chunks.
            if not isinstance(item, (list, str)) and hasattr(item, "kv_transfer_params"):
                params = dict(item.kv_transfer_params or {})
                params["cmx"] = {**(params.get("cmx") or {}), **self._identity}
                item.kv_transfer_params = params
            yield item

    async def __del__(self) -> None:
        await super().__del__()
        # vLLM's AsyncLLM inside Ray's VLLMEngine; its shutdown stops the engine core, which
        # stops its workers (each bounded by vLLM).
        engine = getattr(self, "engine", None)
        client = getattr(engine, "_engine_client", None)
        if client is not None:
            client.shutdown()
        elif engine is not None:  # a Ray that keeps it elsewhere: Serve's kill ends the engine
            log.warning("the engine was not stopped (no _engine_client on %s): its shared "
                        "memory is reaped by the next replica to start here",
                        type(engine).__name__)
        memory = getattr(self, "_memory", None)
        if memory is not None:
            await asyncio.get_running_loop().run_in_executor(None, memory.stopped)
