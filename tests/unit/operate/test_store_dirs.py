"""Store directories that outlive Ray node ids: claims, restarts, two nodes on one machine,
orphans and their collection (no Ray)."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest

from cmx.operate.store_dirs import StoreClaimedError, StoreDirs


def test_a_restarted_node_claims_its_store_again_under_a_new_ray_id(tmp_path: Path) -> None:
    dirs = StoreDirs(str(tmp_path))
    first = dirs.claim("ray-node-a")
    (Path(first.root) / "seg-000001.dat").write_bytes(b"x" * 4096)
    first.release()  # the raylet stopped
    again = dirs.claim("ray-node-b")  # a new Ray node id on the same machine
    assert (again.store_id, again.root) == (first.store_id, first.root)
    assert (Path(again.root) / "seg-000001.dat").exists()
    assert dirs.orphans() == []


def test_two_nodes_on_one_machine_hold_different_stores(tmp_path: Path) -> None:
    dirs = StoreDirs(str(tmp_path))
    a, b = dirs.claim("ray-a"), dirs.claim("ray-b")
    assert a.store_id != b.store_id and a.root != b.root
    a.release()
    b.release()
    # Each Ray node gets back the store it held last, whatever order they restart in.
    b2, a2 = dirs.claim("ray-b"), dirs.claim("ray-a")
    assert (a2.store_id, b2.store_id) == (a.store_id, b.store_id)


def test_a_label_names_the_store_and_is_held_once(tmp_path: Path) -> None:
    dirs = StoreDirs(str(tmp_path))
    held = dirs.claim("ray-a", wanted="rack1-n3")
    assert held.root == str(tmp_path / "node-rack1-n3")
    with pytest.raises(StoreClaimedError, match="rack1-n3"):
        dirs.claim("ray-b", wanted="rack1-n3")
    with pytest.raises(ValueError):
        dirs.claim("ray-b", wanted="../escape")


def test_unclaimed_and_old_layout_directories_are_orphans_collected_by_age(
    tmp_path: Path,
) -> None:
    dirs = StoreDirs(str(tmp_path))
    live = dirs.claim("ray-live")
    gone = dirs.claim("ray-gone")
    (Path(gone.root) / "seg-000001.dat").write_bytes(b"y" * 8192)
    gone.release()
    legacy = tmp_path / "0123456789abcdef"  # named by a Ray node id, as before claims
    legacy.mkdir()
    (legacy / "seg-000001.dat").write_bytes(b"z" * 4096)
    (tmp_path / "pool-disk0").mkdir()  # a pool store: named by its label, never an orphan
    (tmp_path / "notes").mkdir()  # not a store directory
    old = time.time() - 3600
    os.utime(tmp_path / f"node-{gone.store_id}.claim", (old, old))

    orphans = {o.name: o for o in dirs.orphans()}
    assert set(orphans) == {f"node-{gone.store_id}", "0123456789abcdef"}
    assert orphans[f"node-{gone.store_id}"].bytes >= 8192
    assert orphans[f"node-{gone.store_id}"].age_s >= 3000

    removed = dirs.collect(older_than_s=1800)  # only the one unclaimed for an hour
    assert [o.name for o in removed] == [f"node-{gone.store_id}"]
    assert not Path(gone.root).exists()
    assert not (tmp_path / f"node-{gone.store_id}.claim").exists()
    assert [o.name for o in dirs.collect()] == ["0123456789abcdef"]
    assert Path(live.root).exists() and (tmp_path / "pool-disk0").exists()
    assert dirs.orphans() == []


def test_a_store_open_somewhere_is_never_collected(tmp_path: Path) -> None:
    legacy = tmp_path / "fedcba9876543210"
    legacy.mkdir()
    fd = os.open(legacy / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as an open NvmeStore holds it
    try:
        dirs = StoreDirs(str(tmp_path))
        assert dirs.orphans() == [] and dirs.collect() == []
        assert legacy.exists()
    finally:
        os.close(fd)
    assert [o.name for o in StoreDirs(str(tmp_path)).collect()] == ["fedcba9876543210"]
