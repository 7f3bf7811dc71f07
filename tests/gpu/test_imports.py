"""What tests/gpu imports needs none of what the GPU machine lacks (Ray, NIXL, FastAPI).

Runs in a fresh interpreter, so modules other tests imported do not hide a dependency.
"""

from __future__ import annotations

import subprocess
import sys

LIBRARY = ("cmx", "cmx.layout", "cmx.keys", "cmx.checksum", "cmx.buffers", "cmx.tiers",
           "cmx.errors", "cmx.policies", "cmx.simulate")
ABSENT = ("ray", "nixl", "fastapi", "uvicorn", "starlette")


def test_the_library_parts_import_without_ray_nixl_or_fastapi() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {LIBRARY!r}: importlib.import_module(m)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({ABSENT!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]", f"importing the library parts pulled in {out}"
