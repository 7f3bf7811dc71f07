"""Store files are the owner's alone: 0600 files in a 0700 directory that is really ours."""

from __future__ import annotations

import os
import stat

import pytest
from nvme_helpers import key, open_store, payload

from cmx.errors import CmxError
from cmx.storage.nvme.errors import StoreDirectoryError


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_files_are_0600_in_a_0700_directory(tmp_path):
    old = os.umask(0o022)  # the usual umask would make 0644 files in 0755 directories
    try:
        root = tmp_path / "store"
        store = open_store(root)
        store.put(key(0), payload(key(0), 5000))
        store.flush()
        store.close()
    finally:
        os.umask(old)
    assert mode(root) == 0o700
    names = sorted(os.listdir(root))
    assert {"LOCK", "index.arrow", "journal.log", "seg-000001.dat"} <= set(names)
    assert {n: mode(root / n) for n in names} == dict.fromkeys(names, 0o600)


def test_an_older_stores_wide_modes_are_tightened(tmp_path):
    root = tmp_path / "store"
    store = open_store(root)
    store.put(key(0), payload(key(0), 5000))
    store.close()
    os.chmod(root, 0o755)
    for name in os.listdir(root):
        os.chmod(root / name, 0o644)
    store = open_store(root)
    store.close()
    assert mode(root) == 0o700
    assert {mode(root / n) for n in os.listdir(root)} == {0o600}


def test_a_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    root = tmp_path / "planted"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(StoreDirectoryError, match="owned by uid 65534") as refused:
        open_store(root)
    assert isinstance(refused.value, CmxError)
    assert os.listdir(root) == []  # nothing was created in it


def test_a_directory_inside_another_users_directory_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # they could rename our store away and plant their own
    with pytest.raises(StoreDirectoryError, match="parent"):
        open_store(theirs / "store")
    assert os.listdir(theirs) == []


def test_a_symlink_where_the_directory_should_be_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "store"
    root.symlink_to(elsewhere)
    with pytest.raises(StoreDirectoryError, match="symlink"):
        open_store(root)
    assert os.listdir(elsewhere) == []


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
    root = tmp_path / "store"
    root.write_bytes(b"")
    with pytest.raises(StoreDirectoryError, match="not a directory"):
        open_store(root)


def test_a_symlinked_store_file_is_not_followed(tmp_path):
    root = tmp_path / "store"
    store = open_store(root)
    store.close()
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    os.unlink(root / "journal.log")
    os.symlink(target, root / "journal.log")
    with pytest.raises(OSError):
        open_store(root)
    assert target.read_bytes() == b"keep"
