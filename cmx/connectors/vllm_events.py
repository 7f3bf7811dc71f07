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
A save is known by its request's id and its tokens ``[start, end)``: vLLM takes request ids
from its callers, so two saves may share these while their stores are under way, and then
they are announced only if both name the same blocks. Nothing stored into the
namespaces of before a ``reset_cache`` is announced after it, where no later request looks:
neither the saves under way then nor those of requests tracked before it (``SchedulerSide``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["KEEP", "StoreEvents"]

KEEP = 4096  # saves whose store has not ended, remembered for their event
OWNERSHIP = "cmx"


@dataclass
class _Pending:
    """The saves of one request's blocks ``[start, end)`` whose stores have not ended."""

    event: tuple[list[Any], Any, list[int]] | None  # None: nothing to announce
    saves: int = 1


class StoreEvents:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # (req_id, start, end) -> its saves. vLLM takes request ids from its callers, so a
        # later request may bear the id of one whose store is still under way: a save is
        # announced only while every save under its key would announce the same blocks.
        self._planned: OrderedDict[tuple[str, int, int], _Pending] = OrderedDict()
        self._events: list[Any] = []

    def planned(self, req_id: str, hashes: Sequence[Any], tokens: Sequence[int], start: int,
                end: int) -> None:
        """A save of tokens ``[start, end)`` of a request whose block hashes are ``hashes``."""
        event = self._event_of(hashes, tokens, start, end)
        pending = self._planned.pop((req_id, start, end), None)
        if pending is not None:
            pending.saves += 1
            if pending.event != event:  # another request's blocks: which store is which?
                pending.event = None
        self._planned[(req_id, start, end)] = pending or _Pending(event)
        while len(self._planned) > KEEP:
            self._planned.popitem(last=False)

    def ended(self, req_id: str, start: int, tokens: int, committed_tokens: int) -> None:
        """A save's store ended: announced if the service committed every block of it."""
        key = (req_id, start, start + tokens)
        pending = self._planned.get(key)
        if pending is None:
            return
        pending.saves -= 1
        if pending.saves <= 0:
            del self._planned[key]
        if pending.event is None or committed_tokens < tokens or tokens <= 0:
            return
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored

        blocks, parent, token_ids = pending.event
        pending.event = None  # announced once, whichever of its saves commits first
        self._events.append(BlockStored(
            block_hashes=blocks, parent_block_hash=parent, token_ids=token_ids,
            block_size=self.block_size, lora_id=None, medium=MEDIUM_CPU, lora_name=None,
            ownership=OWNERSHIP))

    def cleared(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared

        for pending in self._planned.values():  # their stores' ends are still to come
            pending.event = None
        self._events.append(AllBlocksCleared())

    def take(self) -> list[Any]:
        events, self._events = self._events, []
        return events

    def _event_of(self, hashes: Sequence[Any], tokens: Sequence[int], start: int,
                  end: int) -> tuple[list[Any], Any, list[int]] | None:
        T = self.block_size
        first, last = start // T, end // T
        if last <= first or len(hashes) < last:
            return None  # no hashes for these blocks (prefix caching off): nothing to announce
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        blocks = [maybe_convert_block_hash(h) for h in hashes[first:last]]
        parent = maybe_convert_block_hash(hashes[first - 1]) if first else None
        return blocks, parent, list(tokens[start:end])
