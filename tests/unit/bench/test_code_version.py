"""A benchmark section names the commit it ran, and never a wrong one as clean."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cmx.bench.harness.machine import code_version


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "cmx").mkdir(parents=True)
    (root / "cmx" / "a.py").write_text("A = 1\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return root


def test_a_clean_checkout_is_named_by_its_commit(checkout: Path) -> None:
    assert code_version(checkout) == _git(checkout, "rev-parse", "--short=7", "HEAD")


def test_a_changed_file_or_a_module_git_does_not_track_is_said(checkout: Path) -> None:
    commit = _git(checkout, "rev-parse", "--short=7", "HEAD")
    (checkout / "cmx" / "b.py").write_text("B = 2\n")  # imported code git does not know
    assert code_version(checkout) == f"{commit} with uncommitted changes"
    (checkout / "cmx" / "b.py").unlink()
    (checkout / "cmx" / "a.py").write_text("A = 2\n")
    assert code_version(checkout) == f"{commit} with uncommitted changes"


def test_code_below_a_checkouts_top_is_not_that_checkout(checkout: Path) -> None:
    # An installed copy in a virtual environment inside a checkout: the checkout's commit
    # says nothing of the copy.
    site = checkout / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    assert code_version(site) == "not a git checkout"
    assert code_version(checkout.parent / "nowhere") == "not a git checkout"


def test_gits_environment_does_not_name_another_repository(
    checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(other))
    assert code_version(checkout) == _git(checkout, "--git-dir", str(checkout / ".git"),
                                          "rev-parse", "--short=7", "HEAD")
