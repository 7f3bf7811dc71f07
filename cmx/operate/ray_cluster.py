"""Joining or starting Ray, one way for everything that does: the client, ``cmx up/status/down``
and ``cmx serve``.

- **Embedded** (``start_own()``): a new local Ray cluster of this process's own, even when
  another one runs on the machine or Ray's current-cluster file (``/tmp/ray/ray_current_cluster``)
  names one. What a process starts, it may stop; nothing else.
- **Join** (``join(address)``): the cluster at ``address`` (``host:port``, ``ray://host:port``, or
  ``"auto"``: ``RAY_ADDRESS``, unless that is "auto" too, else the one Ray's current-cluster file
  names). Its GCS port must answer within a bound, else ``ClusterUnreachableError``: ``ray.init``
  itself retries a dead address for minutes.
- **Token authentication** (``match_ray_auth()``): for a head this process starts, decided as
  ``ray start`` decides it: a token on this machine (``~/.ray/auth_token``, written by any
  earlier ``ray.init()``) and no ``RAY_AUTH_MODE`` mean token mode, and every process that joins
  that head must send the token. ``ray.init(address=...)`` alone does not (Ray turns it on only
  for a cluster it finds by itself), so ``join`` does, but only where the cluster asks for it
  (``match_ray_auth(address)`` asks its GCS without a token): a joined process in token mode
  refuses the calls of raylets that send none, and the objects it owns (a store's payload)
  could then never be read on another node of a cluster that runs without authentication.
- **Forgetting a head** (``forget_head(address)``): a stopped head's address left in Ray's
  current-cluster file makes the next plain ``ray.init()`` on the machine wait for it; the file is
  removed only while it names that address and nothing answers there.
- **Trusting the file** (``current_cluster()``): it lies in a temp folder every user may write
  (Ray makes ``/tmp/ray`` 0777), so it is followed only where the file read (opened without
  following a symlink, then checked) is a regular file this user or root owns that other users
  may not write: another user's could send this process's blocks to a cluster of theirs.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from typing import Any

from cmx.errors import UnavailableError
from cmx.links import RAY_NAMESPACE
from cmx.operate.local_ray import (
    RAYLET_TIMEOUT,
    START_ATTEMPTS,
    is_local,
    port_open,
    split_address,
    stop_head,
)

__all__ = ["ClusterUnreachableError", "current_cluster", "forget_head", "join", "join_or_start",
           "locate", "match_ray_auth", "needs_token", "resolve", "start_own", "stop_local_head",
           "wait_for_gcs"]

log = logging.getLogger(__name__)

DEFAULT_JOIN_TIMEOUT_S = 30.0
AUTO_ANSWER_S = 2.0  # how long a head named by Ray's current-cluster file may take to answer


class ClusterUnreachableError(UnavailableError):
    """No Ray cluster answered at the address in time (or no address could be found)."""


def match_ray_auth(address: str | None = None) -> bool:
    """Turn on Ray's token authentication in this process (and the processes it starts) where
    it is needed and ``RAY_AUTH_MODE`` does not decide: with ``address``, where the cluster
    there refuses a call without a token; without, where ``ray start`` would (a token exists).
    True if it is on."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            AUTH_MODE_ENV_VAR,
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    if address is not None and AUTH_MODE_ENV_VAR not in os.environ and \
            not needs_token(address):
        return False
    return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))


def needs_token(address: str) -> bool:
    """Whether the GCS at ``address`` refuses a call that carries no token (asked once,
    bounded; an answer other than a refusal means no)."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # no stubs
    from ray.exceptions import AuthenticationError

    try:
        GcsClient(address=address).internal_kv_get(b"cmx-auth-probe", None, timeout=10)
    except AuthenticationError:
        return True
    except Exception as exc:  # noqa: BLE001 - ray.init reports an unreachable cluster itself
        log.debug("token probe of %s: %s", address, exc)
    return False


def current_cluster(temp_dir: str | None = None) -> str | None:
    """The address in Ray's current-cluster file (the last ``ray start`` here), if any;
    ClusterUnreachableError where the file is not one to trust (see the module docstring)."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(temp_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        raise ClusterUnreachableError(
            f"Ray's current-cluster file {path} cannot be opened as a file of its own "
            f"({exc.strerror}); refusing to follow it: give the address (host:port)") from None
    try:
        problem = _not_trusted(os.fstat(fd))
        if problem:
            raise ClusterUnreachableError(
                f"Ray's current-cluster file {path} {problem}; refusing to follow it: give "
                f"the address (host:port)")
        with os.fdopen(fd, "r", closefd=False) as f:
            return f.read(4096).strip() or None
    finally:
        os.close(fd)


def _not_trusted(file: os.stat_result) -> str | None:
    """Why the current-cluster file opened (``file``) may hold another user's words; None
    where it cannot. Its folder does not matter: what was read is this file."""
    if not stat.S_ISREG(file.st_mode):
        return "is not a regular file"
    if file.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {file.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if file.st_mode & 0o002:
        return f"may be written by any user (mode {stat.S_IMODE(file.st_mode):o})"
    return None


def resolve(address: str) -> str:
    """``address`` as host:port (or ray://host:port). "auto" is read as Ray reads it:
    ``RAY_ADDRESS`` unless that is empty or "auto" itself, else Ray's current-cluster file.
    ClusterUnreachableError if "auto" finds nothing."""
    return _resolve(address)[0]


def _resolve(address: str) -> tuple[str, str | None]:
    """(``resolve(address)``, the current-cluster file it was read from, if it was)."""
    if address != "auto":
        return address, None
    given = os.environ.get("RAY_ADDRESS", "").strip()
    if given and given != "auto":
        return given, None
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    found = current_cluster()
    if not found:
        raise ClusterUnreachableError(
            f"address 'auto': RAY_ADDRESS names no cluster and Ray's current-cluster file "
            f"({path}) is absent: start one with `ray start --head`, or give host:port")
    return found, path


def locate(address: str, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> str:
    """``resolve(address)``, once something answers there (``wait_for_gcs``). A head named by
    Ray's current-cluster file is up when the file is written, so one that does not answer
    within ``AUTO_ANSWER_S`` stopped: ClusterUnreachableError then, naming the file."""
    target, recorded_in = _resolve(address)
    if recorded_in is None:
        wait_for_gcs(target, timeout_s)
        return target
    try:
        wait_for_gcs(target, min(timeout_s, AUTO_ANSWER_S))
    except (ClusterUnreachableError, ValueError) as exc:
        raise ClusterUnreachableError(
            f"address 'auto': Ray's current-cluster file ({recorded_in}) names {target!r}, "
            f"where no Ray cluster answers (a head that stopped?): {exc}") from exc
    return target


def wait_for_gcs(address: str, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> None:
    """Return once something accepts connections at ``address``; ClusterUnreachableError after
    ``timeout_s``. (A head that is starting opens its port within seconds.)"""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while not port_open(host, port):
        if time.monotonic() >= deadline:
            raise ClusterUnreachableError(
                f"no Ray cluster answers at {address} (waited {timeout_s:g} s)")
        time.sleep(0.25)


def join(address: str, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, **ray_init: Any) -> str:
    """Connect this process to the cluster at ``address``; returns the address joined.

    Bounded: ClusterUnreachableError if its GCS does not answer within ``timeout_s``."""
    import ray

    target = locate(address, timeout_s)
    # A Ray Client (ray://) address has no GCS to ask: decided as ``ray start`` would.
    match_ray_auth(None if target.startswith("ray://") else target)
    ray_init.setdefault("namespace", RAY_NAMESPACE)
    try:
        ray.init(address=target, **ray_init)
    except ConnectionError as exc:
        raise ClusterUnreachableError(f"could not join the Ray cluster at {target}: {exc}") \
            from exc
    return target


def start_own(attempts: int = START_ATTEMPTS, **ray_init: Any) -> str:
    """Start a new local Ray cluster for this process (never one already running); returns its
    GCS address. ``ray.shutdown()`` stops it.

    Ray gives a new raylet 30 s to register with its GCS, which a loaded machine can miss; such
    a start is tried again (with a warning), up to ``attempts`` times in all."""
    import ray

    ray_init.setdefault("namespace", RAY_NAMESPACE)
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", **ray_init)
            break
        except Exception as exc:  # Ray raises a bare Exception for this timeout
            if RAYLET_TIMEOUT not in str(exc) or attempt == attempts:
                raise
            log.warning("starting a local Ray cluster failed (attempt %d of %d): %s; trying "
                        "again", attempt, attempts, exc)
            ray.shutdown()
    return str(ray.get_runtime_context().gcs_address)


def join_or_start(address: str | None, timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
                  **ray_init: Any) -> bool:
    """Join ``address`` (else ``RAY_ADDRESS``), or with neither start a cluster of this
    process's own; True if it was started here (so this process may stop it)."""
    target = address or os.environ.get("RAY_ADDRESS") or None
    if target is None:
        start_own(**ray_init)
        return True
    join(target, timeout_s, **ray_init)
    return False


def forget_head(address: str, temp_dir: str | None = None) -> bool:
    """Remove Ray's current-cluster file if it names ``address`` and nothing answers there any
    more (a head that was stopped); True if removed. Another cluster's entry is left alone."""
    from ray._common.utils import get_ray_address_file

    try:
        recorded = current_cluster(temp_dir)
    except ClusterUnreachableError:  # not this user's file: not this user's to remove
        return False
    if not recorded:
        return False
    try:
        host, port = split_address(recorded)
        want_host, want_port = split_address(address)
    except ValueError:
        return False
    if port != want_port or not _same_host(host, want_host) or port_open(host, port):
        return False
    try:
        os.unlink(get_ray_address_file(temp_dir))
    except FileNotFoundError:
        return False
    log.info("forgot the stopped Ray head %s in Ray's current-cluster file", recorded)
    return True


def stop_local_head(pid: int, address: str) -> bool:
    """Stop the ``ray start --block`` head at ``pid`` (see local_ray.stop_head) and forget it in
    Ray's current-cluster file, so the next ``ray.init()`` here does not wait for it."""
    stopped = stop_head(pid)
    if stopped and address != "auto":
        forget_head(address)
    return stopped


def _same_host(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return _ip(a) == _ip(b)
    except OSError:
        return False


def _ip(host: str) -> str:
    # Ray records a local head under the machine's address, users name it 127.0.0.1.
    return "local" if is_local(host) else socket.gethostbyname(host)
