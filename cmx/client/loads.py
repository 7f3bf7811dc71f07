"""Loads through this node's agent, window by window, with several windows asked ahead of the
one being copied out, so that the disk never waits for the client or for a window's calls.

Protocol, per window of ``load_window`` blocks (half the HBM tier, at most ``WINDOW_BYTES``),
with at most ``load_depth`` windows holding pins at once (a load holds at most the whole tier,
and the client's memory stays the caller's tensor):

1. ``agent.load(keys, copies, priority, owner, namespace, of_blocks)``: the window's blocks
   pinned in this node's HBM for ``owner``, a lease of its own per window; ``of_blocks``, the
   whole load's, tells the agent a scan (more than HBM and DRAM hold) from a load that fits
   (``actors/agent/demote.py``: a scan's windows do not demote what NVMe holds to DRAM).
   Up to ``load_depth`` windows are asked for before the first answer is waited for, and each
   window copied out makes room for the next one: the agent serves calls concurrently, so
   one window's pins, demotions and commit run while another's NVMe reads are in flight, and
   the client copies window k out of the HBM arena, each block verified as it is copied
   (``cmx.client.copy_out``), while the windows after it are read.
2. ``agent.release(leases, corrupt)`` after each window's copy, sent at once and waited for
   only when the next window asked for would otherwise make more than ``load_depth`` windows of
   pins (an agent serves calls concurrently, and a window asked for after a release merely
   sent could find the slots of more than ``load_depth`` windows taken).
3. The load ends at the first window that fails, comes back corrupt or comes back short of a
   miss; every window asked ahead of it is given up (``agent.give_up(owner)``: what it holds
   now and what it pins later go back). A window asked for while others of the load were
   still pinned that fails or comes back short (HBM may have had no room beside them) is asked
   for once more, its rest, with nothing else held (every release settled, the windows ahead
   given up), and answered before another is asked for: as a load without overlap would ask.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cmx.buffers import align_up
from cmx.client.copy_out import copy_verified
from cmx.config import ServiceConfig
from cmx.doors import GiveUp, Load, Pending, Release
from cmx.errors import CmxError
from cmx.protocol import Loaded, LoadResult, Priority, actor_name

if TYPE_CHECKING:
    from cmx.client.matches import BlockLocation, Reader

__all__ = ["MAX_DEPTH", "WINDOW_BYTES", "load_depth", "load_through_agent", "load_window",
           "window_blocks"]

log = logging.getLogger(__name__)

# At most this much per window, so that even a prefix of a few windows' worth overlaps its
# reads with its copy out (a window of half a 1 GiB HBM tier held a whole 512 MiB prefix,
# read first and copied out after); a window still keeps the disk's queue full.
WINDOW_BYTES = 128 << 20

# At most this many windows of one load hold pins at once: the one being copied out and those
# asked ahead of it. A window's calls (pins, commit, release: ~25 ms of CPU across the agent
# and the tier actors, whatever its size) are what costs on a machine of few cores, so windows
# are as large as HBM allows (half of it, at most ``WINDOW_BYTES``) and their number follows:
# on a 64 MiB HBM a 512 MiB load from NVMe took 0.83 s in windows of 8 blocks four deep and
# 0.61 s in windows of 16 two deep (fio: 0.59 s); a 1 GiB HBM keeps four of 128 MiB.
MAX_DEPTH = 4


@dataclass(frozen=True)
class _Asked:
    """A window asked of the agent and not yet copied out."""

    start: int  # index of its first block in the load
    size: int  # blocks asked for
    owner: str  # the lease owner of its pins
    ref: Pending[LoadResult]  # the agent's answer, to come
    overlapped: bool  # asked while other windows of the load still held pins


class _Windows:
    """The windows of one load asked of the agent and the releases sent, in order; at most
    ``depth`` of them holding pins (a release counts until it is confirmed)."""

    def __init__(self, ns: Reader, blocks: Sequence[BlockLocation], window: int,
                 depth: int) -> None:
        self.ns = ns
        self.blocks = blocks
        self.window = window
        self.depth = depth
        self.asked: deque[_Asked] = deque()
        self.releasing: deque[Any] = deque()  # releases sent, not yet confirmed
        self.next = 0  # the first block not yet asked for
        self.solo = False  # a window asked again alone: nothing beside it until it answers

    def top_up(self) -> None:
        """Ask for windows until ``depth`` hold pins (one while a window is asked alone)."""
        while self.next < len(self.blocks) and not (self.solo and self.asked):
            if len(self.asked) >= self.depth:
                return
            while self.releasing and len(self.asked) + len(self.releasing) >= self.depth:
                _settle(self.ns, self.releasing.popleft())
            overlapped = bool(self.asked or self.releasing)
            asked = _ask(self.ns, self.blocks, self.next, self.window, overlapped)
            if asked is None:  # the agent is not running: a miss from here on
                self.next = len(self.blocks)
                return
            self.asked.append(asked)
            self.next += asked.size

    def restart_alone(self, start: int) -> None:
        """Give up every window asked ahead, settle every release, and ask from ``start``
        with nothing else held."""
        self.give_up_ahead()
        while self.releasing:
            _settle(self.ns, self.releasing.popleft())
        self.next = start
        self.solo = True

    def give_up_ahead(self) -> None:
        while self.asked:
            _give_up(self.ns, self.asked.popleft())
        self.next = len(self.blocks)


def load_through_agent(ns: Reader, blocks: Sequence[BlockLocation], out: Any,
                       first: int) -> int:
    """Load ``blocks`` through this node's agent into ``out`` from block ``first``; how many
    leading blocks arrived whole."""
    config = ns.cm.config
    windows = _Windows(ns, blocks, load_window(config), load_depth(config))
    done = 0
    while True:
        windows.top_up()
        if not windows.asked:
            return done
        asked = windows.asked.popleft()
        windows.solo = False
        result = _answer(ns, asked)
        if result is None:
            if asked.overlapped:  # asked again alone, as a load without overlap would be
                windows.restart_alone(asked.start)
            else:
                windows.give_up_ahead()
            continue
        got = len(result.blocks)
        try:
            intact, releasing = _copy_out(ns, result, out, first + asked.start)
        except BaseException:
            windows.give_up_ahead()
            raise
        if releasing is not None:
            windows.releasing.append(releasing)
        done += intact
        if intact < got:  # a corrupt block: nothing after it is used
            windows.give_up_ahead()
            return done
        if got < asked.size:
            if not asked.overlapped:  # a miss: the prefix ends here
                windows.give_up_ahead()
                return done
            # maybe only no room beside the windows before it
            log.warning("a window of %d blocks asked beside others brought %d; asking for "
                        "the rest alone", asked.size, got)
            windows.restart_alone(asked.start + got)


def load_window(config: ServiceConfig) -> int:
    """Blocks per window of a load: half the HBM tier, at most ``WINDOW_BYTES``."""
    return min(window_blocks(config), max(1, WINDOW_BYTES // config.block_bytes))


def load_depth(config: ServiceConfig) -> int:
    """Windows of a load holding pins at once: as many as the HBM tier holds, at most
    ``MAX_DEPTH``."""
    return max(1, min(MAX_DEPTH, _hbm_slots(config) // load_window(config)))


def window_blocks(config: ServiceConfig) -> int:
    """Blocks per prefetch call: half the HBM tier, so that two fit in it."""
    return max(1, _hbm_slots(config) // 2)


def _hbm_slots(config: ServiceConfig) -> int:
    """The blocks the HBM tier holds: its arena's slots, each a block rounded up to the page
    (``cmx.storage.arena``)."""
    return config.hbm_bytes // align_up(config.block_bytes)


def _agent(ns: Reader) -> str:
    return actor_name("agent", ns.cm.node_id)


def _ask(ns: Reader, blocks: Sequence[BlockLocation], start: int, window: int,
         overlapped: bool) -> _Asked | None:
    chunk = blocks[start : start + window]
    if not chunk:
        return None
    owner = f"client:{uuid.uuid4().hex}"
    try:
        ref = ns.cm.link.submit(_agent(ns), Load(
            keys=[b.key for b in chunk], copies=[list(b.copies) for b in chunk],
            priority=Priority.LOAD, owner=owner, namespace=ns.namespace.id,
            of_blocks=len(blocks)))
    except CmxError as exc:  # the agent is not running: a miss from here on
        log.warning("load not sent: %s", exc)
        return None
    return _Asked(start, len(chunk), owner, ref, overlapped)


def _answer(ns: Reader, asked: _Asked) -> LoadResult | None:
    """The agent's answer to ``asked``; None (its pins given up) if it failed or was late."""
    try:
        result = ns.cm.link.result(asked.ref, ns.cm.config.load_timeout_s)
    except Exception as exc:  # noqa: BLE001 - a failed or late load is a miss
        log.warning("load failed: %s", exc)
        _give_up(ns, asked)
        return None
    return result


def _give_up(ns: Reader, asked: _Asked | None) -> None:
    if asked is not None:
        ns.cm.link.tell(_agent(ns), GiveUp(owner=asked.owner))


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
            releasing = ns.cm.link.submit(_agent(ns), Release(
                leases=[b.lease for b in result.blocks], corrupt=corrupt))
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
