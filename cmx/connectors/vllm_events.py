"""KV events of ``CMXConnector``, for routers that follow where prefixes are cached: vLLM
publishes them beside its own (``take_events``) when the engine runs with
``--kv-events-config``.

- ``BlockStored`` for the blocks of a save once the workers report every one of them committed
  by the service (visible to every engine's lookup), with vLLM's own block hashes of the
  request, so a router matches them against its prompts as it does the engine's own events.
  ``medium`` is ``"CPU"`` (the service's memory tier, where a store commits) and
  ``ownership`` ``"cmx"``. A save committed only in part is not announced: an event a router
  believes for a block the service does not hold costs a wrong route.
- ``AllBlocksCleared`` after ``reset_cache``: the engine's namespaces were dropped.

Nothing is said of blocks the service evicts later; a router takes a block announced here as
likely, not certain, as the events of a bounded cache always are.

The hashes are taken when a save is planned (vLLM's ``Request.block_hashes``, one per full
block; none when prefix caching is off, and then no events) and kept until its store ends;
saves whose end is never reported (dropped before the store) are forgotten past ``KEEP``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["KEEP", "StoreEvents"]

KEEP = 4096  # saves whose store has not ended, remembered for their event
OWNERSHIP = "cmx"


class StoreEvents:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._planned: OrderedDict[tuple[str, int], tuple[list[Any], Any, list[int]]] = (
            OrderedDict())
        self._events: list[Any] = []

    def planned(self, req_id: str, hashes: Sequence[Any], tokens: Sequence[int], start: int,
                end: int) -> None:
        """A save of tokens ``[start, end)`` of a request whose block hashes are ``hashes``."""
        T = self.block_size
        first, last = start // T, end // T
        if last <= first or len(hashes) < last:
            return  # no hashes for these blocks (prefix caching off): nothing to announce
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        blocks = [maybe_convert_block_hash(h) for h in hashes[first:last]]
        parent = maybe_convert_block_hash(hashes[first - 1]) if first else None
        self._planned[(req_id, start)] = (blocks, parent, list(tokens[start:end]))
        while len(self._planned) > KEEP:
            self._planned.popitem(last=False)

    def ended(self, req_id: str, start: int, tokens: int, committed_tokens: int) -> None:
        """A save's store ended: announced if the service committed every block of it."""
        planned = self._planned.pop((req_id, start), None)
        if planned is None or committed_tokens < tokens or tokens <= 0:
            return
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored

        blocks, parent, token_ids = planned
        self._events.append(BlockStored(
            block_hashes=blocks, parent_block_hash=parent, token_ids=token_ids,
            block_size=self.block_size, lora_id=None, medium=MEDIUM_CPU, lora_name=None,
            ownership=OWNERSHIP))

    def cleared(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared

        self._planned.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events
