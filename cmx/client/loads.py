"""Loads through this node's agent, window by window, the next window read while this one is
copied out.

Protocol, per window of half the HBM tier or ``WINDOW_BYTES``, whichever is less (two windows
in flight at most, so a load holds at most the whole tier, and the client's memory stays the
caller's tensor):

1. ``agent.load(keys, copies, priority, owner)``: the window's blocks pinned in this node's
   HBM for ``owner``, a lease of its own per window. As soon as window k has answered whole,
   window k+1 is asked for, and the agent reads it (NVMe, a peer, the pool) while the client
   copies window k out of the HBM arena, each block verified as it is copied
   (``cmx.client.copy_out``).
2. ``agent.release(leases, corrupt)`` after each window's copy, sent at once and waited for
   only before the window after next is asked for (by then long done): an agent serves
   calls concurrently, and a window asked for after a release merely sent could find the
   slots of three windows taken.
3. The load ends at the first window that fails, comes back corrupt or comes back short of a
   miss; the window asked for ahead of it is given up (``agent.give_up(owner)``: what it
   holds now and what it pins later go back). A window asked for while the one before it was
   still pinned that fails or comes back short (HBM may have had no room for both) is asked
   for once more, its rest, with nothing else held: as a load without overlap would ask.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cmx.client.copy_out import copy_verified
from cmx.config import ServiceConfig
from cmx.errors import CmxError
from cmx.protocol import Loaded, LoadResult, Priority, actor_name

if TYPE_CHECKING:
    from cmx.client.matches import BlockLocation, Reader

__all__ = ["WINDOW_BYTES", "load_through_agent", "window_blocks"]

log = logging.getLogger(__name__)

# At most this much per window, so that even a prefix of a few windows' worth overlaps its
# reads with its copy out (a window of half a 1 GiB HBM tier held a whole 512 MiB prefix,
# read first and copied out after); a window still keeps the disk's queue full.
WINDOW_BYTES = 128 << 20


@dataclass(frozen=True)
class _Asked:
    """A window asked of the agent and not yet copied out."""

    start: int  # index of its first block in the load
    size: int  # blocks asked for
    owner: str  # the lease owner of its pins
    ref: Any  # the agent's answer, to come
    overlapped: bool  # asked while the window before it was still pinned


def load_through_agent(ns: Reader, blocks: Sequence[BlockLocation], out: Any,
                       first: int) -> int:
    """Load ``blocks`` through this node's agent into ``out`` from block ``first``; how many
    leading blocks arrived whole."""
    window = min(window_blocks(ns.cm.config), max(1, WINDOW_BYTES // ns.cm.config.block_bytes))
    ahead = _ask(ns, blocks, 0, window, overlapped=False)
    releasing: Any = None  # the release of the window before, under way
    done = 0
    while ahead is not None:
        asked, ahead = ahead, None
        result = _answer(ns, asked)
        _settle(ns, releasing)  # that window's slots are free before the next is asked
        releasing = None
        if result is None:
            if asked.overlapped:  # asked again alone, as a load without overlap would be
                ahead = _ask(ns, blocks, asked.start, window, overlapped=False)
            continue
        got = len(result.blocks)
        if got == asked.size and asked.start + got < len(blocks):
            ahead = _ask(ns, blocks, asked.start + got, window, overlapped=True)
        try:
            intact, releasing = _copy_out(ns, result, out, first + asked.start)
        except BaseException:
            _give_up(ns, ahead)
            raise
        done += intact
        if intact < got:  # a corrupt block: nothing after it is used
            _give_up(ns, ahead)
            break
        if got < asked.size and asked.overlapped:  # maybe only no room beside the last one
            log.warning("a window of %d blocks asked beside the one before it brought %d; "
                        "asking for the rest alone", asked.size, got)
            _settle(ns, releasing)
            releasing = None
            ahead = _ask(ns, blocks, asked.start + got, window, overlapped=False)
    return done


def window_blocks(config: ServiceConfig) -> int:
    """Blocks per agent call: half the HBM tier, so that two windows fit in it."""
    return max(1, config.hbm_bytes // config.block_bytes // 2)


def _agent(ns: Reader) -> str:
    return actor_name("agent", ns.cm.node_id)


def _ask(ns: Reader, blocks: Sequence[BlockLocation], start: int, window: int,
         overlapped: bool) -> _Asked | None:
    chunk = blocks[start : start + window]
    if not chunk:
        return None
    owner = f"client:{uuid.uuid4().hex}"
    try:
        ref = ns.cm.link.submit(_agent(ns), "load", [b.key for b in chunk],
                                [list(b.copies) for b in chunk], Priority.LOAD, owner,
                                ns.namespace.id)
    except CmxError as exc:  # the agent is not running: a miss from here on
        log.warning("load not sent: %s", exc)
        return None
    return _Asked(start, len(chunk), owner, ref, overlapped)


def _answer(ns: Reader, asked: _Asked) -> LoadResult | None:
    """The agent's answer to ``asked``; None (its pins given up) if it failed or was late."""
    try:
        result: LoadResult = ns.cm.link.result(asked.ref, ns.cm.config.load_timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed or late load is a miss
        log.warning("load failed: %s", exc)
        _give_up(ns, asked)
        return None
    return result


def _give_up(ns: Reader, asked: _Asked | None) -> None:
    if asked is not None:
        ns.cm.link.tell(_agent(ns), "give_up", asked.owner)


def _copy_out(ns: Reader, result: LoadResult, out: Any, first: int
              ) -> tuple[int, Any]:
    """Copy a window's blocks out of the HBM arena, verified; its pins released after, with
    the corrupt copy if any. (How many were whole, the release under way.)"""
    if not result.blocks:
        return 0, None
    intact = 0
    corrupt: list[Loaded] = []
    try:
        arena = ns.cm.plane.arena(result.arena)
        intact, corrupt = copy_verified(ns.layout, arena, result.blocks, out, first,
                                        ns.verify)
    except (CmxError, OSError, ValueError) as exc:  # the HBM tier restarted: arena gone
        log.warning("load's arena %s is gone: %s", result.arena, exc)
    finally:
        try:
            releasing = ns.cm.link.submit(_agent(ns), "release",
                                          [b.lease for b in result.blocks], corrupt)
        except CmxError as exc:  # the agent is gone: the pins expire as leases
            log.warning("release not sent: %s", exc)
            releasing = None
    return intact, releasing


def _settle(ns: Reader, releasing: Any) -> None:
    """Wait for a window's release (an agent serves calls concurrently: a window asked for
    after a release merely sent may be granted slots before that release has run)."""
    if releasing is None:
        return
    try:
        ns.cm.link.result(releasing, ns.cm.config.call_timeout_s)
    except Exception as exc:  # noqa: BLE001 - the pins expire as leases
        log.warning("release not confirmed: %s", exc)
