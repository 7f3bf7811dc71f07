"""The dashboard page in headless Chromium: after its script ran, every node's tiers have bars.

Needs the Debian package ``chromium``; the screenshot is left in the test's tmp folder
(``dashboard.png``) for a look.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
from support import LAYOUT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, "the dashboard test needs chromium (apt-get install chromium)"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,1400",
           "--virtual-time-budget=5000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_dashboard_draws_a_bar_per_node_and_tier(
    admin_api: Any, cm: Any, nodes: tuple[str, str], tmp_path: Path
) -> None:
    toks = np.random.default_rng(201).integers(0, 50_000, 4 * LAYOUT.block_tokens,
                                                 dtype=np.uint32)
    cm.namespace("m-api-page", LAYOUT, "t").store(toks, LAYOUT.random_kv(len(toks))).wait()
    page = admin_api.url + "/"

    dom = chromium(tmp_path / "profile", "--dump-dom", page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    bars = re.findall(r'<div class="tier-bar" data-tier="(\w+)" data-node="(\w+)"', dom.stdout)
    for node in nodes:
        assert {tier for tier, n in bars if n == node} == {"hbm", "dram", "nvme"}, bars
    assert 'class="status ok">live<' in dom.stdout
    assert "emulated" in dom.stdout

    shot = tmp_path / "dashboard.png"
    result = chromium(tmp_path / "profile", f"--screenshot={shot}", page)
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.stat().st_size > 10_000
