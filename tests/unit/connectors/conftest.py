"""The connector's tests reach the in-process service plane of ``tests/unit/actors``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "actors"))
