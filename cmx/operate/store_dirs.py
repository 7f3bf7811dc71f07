"""Stable store directories: a node finds its NVMe store again after a restart.

A Ray node id is new at every start of a raylet, so it cannot name a node's disk. Under
``nvme_dir`` each node's store lives in ``node-<id>/``, where ``<id>`` is the node's stable id:
the value of its ``cmx.io/node-id`` label if it has one, else an id claimed at start.

Claims. ``node-<id>.claim`` beside the store is flock-ed by the node's NVMe tier for as long as
it runs, and records the Ray node that holds it. At start a node claims, in this order: the id
its label names; the id last held by the same Ray node (its tier restarted, its raylet did not);
any id that no running node holds (the raylet or the whole cluster restarted: this machine's
disk is the store); else a new id. Several raylets on one machine (``ray.cluster_utils.Cluster``)
each hold a different claim, so each finds a store of its own.

Orphans. A store directory that no running node claims, and old directories named by Ray node
ids (16 hex digits, the layout before claims), are orphans: listed in the tier's stats and
removed by ``collect(older_than_s)`` (an admin action, and the tier itself once they are older
than ``ServiceConfig.orphan_max_age_s``). A directory whose store is open anywhere (its ``LOCK``
is held) is never removed; pool stores (``pool-<label value>``) are named by their label and are
never orphans here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from cmx.errors import CmxError
from cmx.operate.degraded import Fallback, describe, direct_io_refused
from cmx.stats import DiskStats

__all__ = ["Claim", "NodeDisk", "Orphan", "StoreDirs", "StoreClaimedError"]

log = logging.getLogger(__name__)

_CLAIMED = re.compile(r"^node-([A-Za-z0-9_.-]{1,64})$")
_LEGACY = re.compile(r"^[0-9a-f]{16}$")  # a Ray node id's first 16 hex digits
MINE_TRIES = 20  # a restarted tier's own claim: tries, 50 ms apart (another's scan holds it)


class StoreClaimedError(CmxError):
    """The store id a node's label names is held by another running node."""


@dataclass(frozen=True)
class Orphan:
    name: str  # directory under nvme_dir
    bytes: int  # disk space it takes
    age_s: float  # since a node last held it


@dataclass
class Claim:
    """A held claim: the store id, its directory, and the open claim file (closing releases)."""

    store_id: str
    root: str
    fd: int

    def touch(self) -> None:
        """Mark the claim as held now (an orphan's age counts from its last touch)."""
        os.utime(self.fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StoreDirs:
    """The store directories under one ``nvme_dir`` of one machine."""

    def __init__(self, base: str) -> None:
        self.base = base

    def store_root(self, store_id: str) -> str:
        return os.path.join(self.base, f"node-{store_id}")

    def claim(self, ray_node: str, wanted: str | None = None) -> Claim:
        """Claim a store id for ``ray_node`` (see the module's docstring for the order)."""
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        if wanted is not None:
            if not _CLAIMED.match(f"node-{wanted}"):
                raise ValueError(f"store id {wanted!r}: letters, digits, '_', '.', '-' only")
            held = self._try_claim(wanted, ray_node)
            if held is None:
                raise StoreClaimedError(f"store id {wanted!r} under {self.base} is held by "
                                        "another running node")
            return held
        ids = self._claim_ids()
        mine = [i for i in ids if self._holder(i) == ray_node]
        for store_id in mine:  # held for an instant by another node's orphan scan: retry
            for _ in range(MINE_TRIES):
                held = self._try_claim(store_id, ray_node)
                if held is not None:
                    return held
                time.sleep(0.05)
        for store_id in sorted(set(ids) - set(mine)):
            held = self._try_claim(store_id, ray_node)
            if held is not None:
                return held
        while True:  # a new id; the loop only repeats on a collision of random ids
            held = self._try_claim(uuid.uuid4().hex[:16], ray_node)
            if held is not None:
                return held

    def orphans(self) -> list[Orphan]:
        """Store directories no running node claims, oldest first."""
        found = []
        now = time.time()
        for name in sorted(os.listdir(self.base)) if os.path.isdir(self.base) else []:
            path = os.path.join(self.base, name)
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            claimed = _CLAIMED.match(name)
            if not claimed and not _LEGACY.match(name):
                continue
            stamp = self._claim_path(claimed.group(1)) if claimed else path
            with self._unheld(claimed.group(1) if claimed else None, path) as free:
                if not free:
                    continue
                try:
                    age = now - os.stat(stamp).st_mtime
                except FileNotFoundError:
                    age = now - os.stat(path).st_mtime
                found.append(Orphan(name, _disk_bytes(path), max(0.0, age)))
        return sorted(found, key=lambda o: -o.age_s)

    def collect(self, older_than_s: float = 0.0) -> list[Orphan]:
        """Remove orphans at least ``older_than_s`` old; returns those removed."""
        removed = []
        for orphan in self.orphans():
            if orphan.age_s < older_than_s:
                continue
            claimed = _CLAIMED.match(orphan.name)
            store_id = claimed.group(1) if claimed else None
            path = os.path.join(self.base, orphan.name)
            with self._unheld(store_id, path) as free:
                if not free:  # claimed since it was listed
                    continue
                shutil.rmtree(path, ignore_errors=True)
                if store_id is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._claim_path(store_id))
            log.warning("removed the orphaned store directory %s (%d bytes, %.0f s unclaimed)",
                        path, orphan.bytes, orphan.age_s)
            removed.append(orphan)
        return removed

    # -- claims --------------------------------------------------------------------------------

    def _claim_path(self, store_id: str) -> str:
        return os.path.join(self.base, f"node-{store_id}.claim")

    def _claim_ids(self) -> list[str]:
        ids = []
        for name in os.listdir(self.base):
            if name.endswith(".claim") and _CLAIMED.match(name[: -len(".claim")]):
                ids.append(name[len("node-"): -len(".claim")])
        return sorted(ids)

    def _holder(self, store_id: str) -> str | None:
        try:
            with open(self._claim_path(store_id)) as f:
                return str(json.load(f).get("ray_node"))
        except (OSError, ValueError, AttributeError):
            return None

    def _try_claim(self, store_id: str, ray_node: str) -> Claim | None:
        fd = os.open(self._claim_path(store_id), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        record = {"ray_node": ray_node, "host": socket.gethostname(), "pid": os.getpid(),
                  "claimed_at": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        root = self.store_root(store_id)
        os.makedirs(root, mode=0o700, exist_ok=True)
        return Claim(store_id, root, fd)

    @contextlib.contextmanager
    def _unheld(self, store_id: str | None, root: str) -> Iterator[bool]:
        """Hold the claim (if any) and the store's LOCK for the duration; False if either is
        held by someone else (a running node, an open store)."""
        fds: list[int] = []
        try:
            paths = ([self._claim_path(store_id)] if store_id is not None else []) + \
                [os.path.join(root, "LOCK")]
            for path in paths:
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    continue
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    yield False
                    return
            yield True
        finally:
            for fd in fds:
                os.close(fd)


class NodeDisk:
    """A node's side of ``nvme_dir``: its claim, the orphans it sees (rescanned by ``scan``,
    which also removes those past ``orphan_max_age_s``; 0: never), and whether its filesystem
    takes O_DIRECT."""

    def __init__(self, base: str, ray_node: str, store_id: str | None,
                 orphan_max_age_s: float) -> None:
        self.dirs = StoreDirs(base)
        self.claim = self.dirs.claim(ray_node, store_id)
        self.max_age_s = orphan_max_age_s
        refused = direct_io_refused(self.claim.root)
        self.degraded = None if refused is None else describe(Fallback.BUFFERED_IO, refused)
        if self.degraded:
            log.warning("the NVMe tier of node %s runs on buffered I/O: %s", ray_node, refused)
        self._orphans: list[Orphan] = []
        self.scan()

    @property
    def root(self) -> str:
        return self.claim.root

    def scan(self) -> None:
        self.claim.touch()
        if self.max_age_s > 0:
            self.dirs.collect(self.max_age_s)
        self._orphans = self.dirs.orphans()

    def orphans(self) -> list[Orphan]:
        self._orphans = self.dirs.orphans()
        return list(self._orphans)

    def collect(self, older_than_s: float = 0.0) -> list[Orphan]:
        removed = self.dirs.collect(older_than_s)
        self._orphans = self.dirs.orphans()
        return removed

    def stats(self) -> DiskStats:
        """For the tier's stats: its store and the orphans last seen (a fallback in force is
        ``degraded``)."""
        return DiskStats(self.claim.store_id, len(self._orphans),
                         sum(o.bytes for o in self._orphans))

    def release(self) -> None:
        self.claim.release()


def _disk_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
    return total
