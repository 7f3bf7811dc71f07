"""The API key file of the OpenAI application: which tenant each key belongs to.

One key a line, ``<tenant> sha256:<64 hex digits>`` (the SHA-256 of the key's UTF-8 bytes);
blank lines and ``#`` comments are skipped, and a tenant may hold several keys. The key itself is
never written: ``new_key`` draws 32 random bytes (``secrets``), so an unsalted SHA-256 is as hard
to reverse as the key is to guess, and a lookup is one hash and one dictionary probe.

The file must be a regular file that neither group nor others may read or write (mode 0600 or
stricter); ``KeyFile.load`` refuses any other, and every line it cannot read, with a
``KeyFileError`` naming the file and the line. ``add_key`` (``cmx keys add``) writes a new file
of mode 0600 and renames it over the old one, so a reader sees the old file or the new, whole.
A key file that is a symbolic link (a managed secret linked into place) is written through: the
new file goes beside the link's target and over it, and the link stays. Adds hold an exclusive
``flock`` on the target's directory from their read to their rename, so two at once lose no key.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

from cmx.errors import CmxError

__all__ = ["KEY_PREFIX", "KeyFile", "KeyFileError", "add_key", "hash_key", "new_key"]

KEY_PREFIX = "cmx-"  # every key this module makes starts so (a secret scanner can find them)
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
LINE_RE = re.compile(r"(\S+)\s+sha256:([0-9a-f]{64})")


class KeyFileError(CmxError, ValueError):
    """A key file that cannot be used: missing, open to group or others, or malformed."""


def hash_key(key: str) -> str:
    """The SHA-256 of a key's UTF-8 bytes, in hex: what the file stores for it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A new random key: ``cmx-`` and 32 random bytes in URL-safe base64."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class KeyFile:
    """The keys of one file, by hash; who a key belongs to is ``tenant(key)``."""

    path: str
    tenants: Mapping[str, str] = field(repr=False)  # sha256 hex of a key -> its tenant

    @classmethod
    def load(cls, path: str) -> KeyFile:
        """The file's keys; ``KeyFileError`` if it is missing, open to others or malformed."""
        return cls(path, MappingProxyType(_parse(path, _read_private(path), allow_empty=False)))

    def tenant(self, key: str) -> str | None:
        """The tenant of ``key``, or None if the file does not hold it."""
        return self.tenants.get(hash_key(key))

    @property
    def tenant_names(self) -> frozenset[str]:
        return frozenset(self.tenants.values())


def add_key(path: str, tenant: str) -> str:
    """Add a new key of ``tenant`` to the file (made, mode 0600, if missing); the key.

    The key is returned once and stored nowhere: a lost key is replaced by adding another.
    """
    if not TENANT_RE.fullmatch(tenant):
        raise KeyFileError(f"tenant {tenant!r}: use 1-64 letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit")
    target = os.path.realpath(path)  # a link's target gets the key; the link stays
    with _locked(target):
        text = _read_private(path) if os.path.lexists(target) else ""
        _parse(path, text, allow_empty=True)  # never extend a file that would not load
        key = new_key()
        if text and not text.endswith("\n"):
            text += "\n"
        _write_private(target, f"{text}{tenant} sha256:{hash_key(key)}\n")
    return key


@contextmanager
def _locked(target: str) -> Iterator[None]:
    """An exclusive lock on the directory ``target`` is renamed into, not on the file: the
    rename replaces the file, and a lock on the replaced one would hold nobody back (nor does
    it leave a lock file beside the keys)."""
    fd = os.open(os.path.dirname(target), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # per open file: it holds off threads, too
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_private(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY)  # a link is followed: its target is checked
    except FileNotFoundError:
        raise KeyFileError(f"key file {path} does not exist") from None
    except OSError as exc:
        raise KeyFileError(f"key file {path} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeyFileError(f"key file {path} has mode {mode:04o}: group or others may read "
                               f"or write it; run `chmod 600 {path}`")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeyFileError(f"key file {path} is not UTF-8 text: {exc}") from None


def _parse(path: str, text: str, allow_empty: bool) -> dict[str, str]:
    tenants: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = LINE_RE.fullmatch(line)
        if match is None or not TENANT_RE.fullmatch(match.group(1)):
            raise KeyFileError(f"key file {path} line {number}: expected "
                               "'<tenant> sha256:<64 lowercase hex digits>'")
        tenant, digest = match.groups()
        if digest in tenants:
            raise KeyFileError(f"key file {path} line {number}: a key listed twice")
        tenants[digest] = tenant
    if not tenants and not allow_empty:
        raise KeyFileError(f"key file {path} holds no key: add one with `cmx keys add TENANT "
                           f"--file {path}`")
    return tenants


def _write_private(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
