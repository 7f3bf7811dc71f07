"""The OpenAI application's API key file: keys stored as their SHA-256 in a file of mode 0600,
each naming a tenant; a file that is open to others or malformed is refused with a typed error
and left as it was; the tenancy built on it (who a request is, and its salt)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cmx.cli import app as cli
from cmx.deploy.apikeys import KeyFile, KeyFileError, add_key, hash_key
from cmx.deploy.config import ServeOptions, TenantOptions
from cmx.deploy.tenants import (
    ANONYMOUS,
    Tenancy,
    Tenant,
    TenantKind,
    UnknownKeyError,
    named_salt,
    tenant_salt,
)

HOLD_S = 1.0  # how long the first of two adds waits for the second to read


def test_keys_are_stored_as_their_sha256_and_looked_up_to_their_tenant(tmp_path: Path) -> None:
    path = str(tmp_path / "keys")
    a1, a2, b = add_key(path, "alice"), add_key(path, "alice"), add_key(path, "bob")
    assert len({a1, a2, b}) == 3 and all(k.startswith("cmx-") for k in (a1, a2, b))
    text = Path(path).read_text()
    assert text == "".join(f"{t} sha256:{hashlib.sha256(k.encode()).hexdigest()}\n"
                           for t, k in (("alice", a1), ("alice", a2), ("bob", b)))
    assert all(k not in text for k in (a1, a2, b))  # never the key itself
    assert hash_key(a1) == hashlib.sha256(a1.encode("utf-8")).hexdigest()
    keys = KeyFile.load(path)
    assert (keys.tenant(a1), keys.tenant(a2), keys.tenant(b)) == ("alice", "alice", "bob")
    assert keys.tenant(a1 + "x") is None and keys.tenant("") is None
    assert keys.tenant(hash_key(a1)) is None  # the stored hash is not a key
    assert keys.tenant_names == {"alice", "bob"}
    assert a1 not in repr(keys) and hash_key(a1) not in repr(keys)


def test_a_new_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        add_key(str(tmp_path / "keys"), "alice")
    finally:
        os.umask(old)
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]  # no temporary left


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644, 0o666], ids=lambda m: f"{m:04o}")
def test_a_file_open_to_group_or_others_is_refused_and_left_alone(tmp_path: Path,
                                                                  mode: int) -> None:
    path = tmp_path / "keys"
    add_key(str(path), "alice")
    before = path.read_bytes()
    path.chmod(mode)
    with pytest.raises(KeyFileError, match=f"mode {mode:04o}.*chmod 600"):
        KeyFile.load(str(path))
    with pytest.raises(KeyFileError, match=f"mode {mode:04o}"):
        add_key(str(path), "bob")
    assert path.read_bytes() == before and path.stat().st_mode & 0o777 == mode
    path.chmod(0o400)  # stricter than 0600 is fine
    assert KeyFile.load(str(path)).tenant_names == {"alice"}


BAD_FILES = {
    "no sha256 prefix": "alice 0123\n",
    "upper-case hex": f"alice sha256:{'AB' * 32}\n",
    "a short digest": f"alice sha256:{'ab' * 31}\n",
    "a key in the clear": "alice cmx-secret\n",
    "a bad tenant name": f"-alice sha256:{'ab' * 32}\n",
    "three fields": f"alice sha256:{'ab' * 32} extra\n",
    "a key listed twice": f"alice sha256:{'ab' * 32}\nbob sha256:{'ab' * 32}\n",
    "no key at all": "# only a comment\n\n",
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_malformed_file_is_a_typed_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / "keys"
    path.write_text(BAD_FILES[name])
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match=str(path)):
        KeyFile.load(str(path))


def test_missing_files_directories_and_binary_files_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        KeyFile.load(str(tmp_path / "nothing"))
    with pytest.raises(KeyFileError, match="not a regular file|cannot be opened"):
        KeyFile.load(str(tmp_path))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe alice")
    binary.chmod(0o600)
    with pytest.raises(KeyFileError, match="UTF-8"):
        KeyFile.load(str(binary))
    good = tmp_path / "good"
    good.write_text(f"# operators' notes\n\nalice sha256:{'ab' * 32}  # laptop\n")
    good.chmod(0o600)
    assert KeyFile.load(str(good)).tenants == {"ab" * 32: "alice"}


def test_add_refuses_a_bad_tenant_or_a_malformed_file_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    for tenant in ("", "a b", "-x", "x" * 65, "al#ice"):
        with pytest.raises(KeyFileError, match="tenant"):
            add_key(str(path), tenant)
    assert not path.exists()
    path.write_text("garbage\n")
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match="line 1"):
        add_key(str(path), "alice")
    assert path.read_text() == "garbage\n"


def test_an_add_through_a_link_writes_the_target_and_keeps_the_link(tmp_path: Path) -> None:
    secrets_dir, link = tmp_path / "secrets", tmp_path / "keys"
    secrets_dir.mkdir()
    target = secrets_dir / "api-keys"
    alice = add_key(str(target), "alice")
    link.symlink_to(os.path.relpath(target, tmp_path))  # a managed secret linked into place
    added = CliRunner().invoke(cli, ["keys", "add", "bob", "--file", str(link)])
    assert added.exit_code == 0, added.output
    assert link.is_symlink() and link.resolve() == target
    assert target.stat().st_mode & 0o777 == 0o600
    keys = KeyFile.load(str(link))
    assert keys.tenant(alice) == "alice" and keys.tenant(added.stdout.strip()) == "bob"
    assert sorted(p.name for p in secrets_dir.iterdir()) == ["api-keys"]  # no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys", "secrets"]


def test_two_adds_at_once_lose_no_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first add, having read the file, waits for the second to read it too: without a
    lock both extend the same text and the later rename drops the first key. With one, the
    second cannot read until the first has renamed; the first waits out ``HOLD_S``."""
    from cmx.deploy import apikeys

    path = str(tmp_path / "keys")
    add_key(path, "alice")
    real_read, reads = apikeys._read_private, []
    second_read = threading.Event()

    def read(p: str) -> str:
        text = real_read(p)
        reads.append(threading.current_thread().name)
        if len(reads) == 1:  # the first add, between its read and its write
            started.set()
            second_read.wait(HOLD_S)
        else:
            second_read.set()
        return text

    monkeypatch.setattr(apikeys, "_read_private", read)
    started, added = threading.Event(), {}

    def add(tenant: str) -> None:
        added[tenant] = add_key(path, tenant)

    first = threading.Thread(target=add, args=("bob",), name="bob")
    second = threading.Thread(target=add, args=("carol",), name="carol")
    first.start()
    assert started.wait(HOLD_S)
    second.start()
    first.join(4 * HOLD_S)
    second.join(4 * HOLD_S)
    assert reads == ["bob", "carol"] and set(added) == {"bob", "carol"}
    keys = KeyFile.load(path)
    assert keys.tenant_names == {"alice", "bob", "carol"}
    assert all(keys.tenant(key) == tenant for tenant, key in added.items())


def test_the_cli_prints_a_new_key_once_and_refuses_an_open_file(tmp_path: Path) -> None:
    runner = CliRunner()
    path = tmp_path / "keys"
    added = runner.invoke(cli, ["keys", "add", "alice", "--file", str(path)])
    assert added.exit_code == 0, added.output
    key = added.stdout.strip()
    assert KeyFile.load(str(path)).tenant(key) == "alice" and key not in path.read_text()
    listed = runner.invoke(cli, ["keys", "list", "--file", str(path)])
    assert listed.exit_code == 0 and listed.stdout.split() == ["alice", "1", "key"]
    path.chmod(0o644)
    refused = runner.invoke(cli, ["keys", "add", "bob", "--file", str(path)])
    assert refused.exit_code == 2 and "chmod 600" in refused.output
    assert path.read_text().count("sha256:") == 1


def test_tenant_options_come_from_the_environment_and_travel_in_the_args() -> None:
    env = {"CMX_API_KEY_FILE": "/etc/cmx/keys", "CMX_API_ANONYMOUS": "1"}
    assert TenantOptions.from_env(env) == TenantOptions("/etc/cmx/keys", anonymous=True)
    assert TenantOptions.from_env({}) == TenantOptions(None, anonymous=False)
    with pytest.raises(ValueError, match="CMX_API_ANONYMOUS"):
        TenantOptions.from_env({"CMX_API_ANONYMOUS": "maybe"})
    options = ServeOptions(tenants=TenantOptions("/k"))
    assert ServeOptions.from_args(options.to_args()).tenants == TenantOptions("/k")


def tenancy_of(tmp_path: Path, anonymous: bool = False) -> tuple[Tenancy, str, str, str]:
    path = str(tmp_path / "keys")
    a1, a2, b = add_key(path, "alice"), add_key(path, "alice"), add_key(path, "bob")
    return Tenancy.load("deploy", TenantOptions(path, anonymous)), a1, a2, b


def test_with_a_key_file_each_key_is_its_tenant_and_others_are_refused(tmp_path: Path) -> None:
    tenancy, a1, a2, b = tenancy_of(tmp_path)
    alice = tenancy.who(f"Bearer {a1}")
    assert alice == tenancy.who(f"bearer  {a2} ") == Tenant(TenantKind.NAMED, "alice")
    assert tenancy.who(f"Bearer {b}") == Tenant(TenantKind.NAMED, "bob")
    for header in (None, "", "Bearer ", f"Basic {a1}", f"Bearer {a1}x", "Bearer tenant-a"):
        with pytest.raises(UnknownKeyError):
            tenancy.who(header)
    salts = {tenancy.salt(alice, None), tenancy.salt(Tenant(TenantKind.NAMED, "bob"), None),
             tenancy.salt(alice, "project"), tenant_salt("deploy", "alice", None), "deploy"}
    assert len(salts) == 5  # a named tenant's salt is no open key's and no anonymous one's
    assert tenancy.salt(alice, None) == named_salt("deploy", "alice", None)


def test_anonymous_use_is_a_setting_and_an_unknown_key_stays_refused(tmp_path: Path) -> None:
    tenancy, *_ = tenancy_of(tmp_path, anonymous=True)
    assert tenancy.who(None) == ANONYMOUS and tenancy.salt(ANONYMOUS, None) == "deploy"
    with pytest.raises(UnknownKeyError):
        tenancy.who("Bearer not-a-key")
    # No key file: every request is served, each bearer key its own tenant.
    open_ = Tenancy("deploy")
    assert open_.who(None) == ANONYMOUS
    k = open_.who("Bearer k1")
    assert k.kind is TenantKind.KEY and "k1" not in repr(k)
    assert open_.salt(k, None) == tenant_salt("deploy", "k1", None)


def test_a_bad_key_file_fails_the_tenancy_with_the_typed_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        Tenancy.load("", TenantOptions(str(tmp_path / "missing")))
