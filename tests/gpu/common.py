"""What the GPU tests share: timing on a stream with events, and where the tables go.

Kept free of pytest, so ``standalone.py`` can run the tests on a machine without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["GB", "MiB", "out_dir", "time_on_stream", "write_table"]

MiB = 1 << 20
GB = 1e9


def out_dir() -> Path:
    """Where tables go: ``$CMX_GPU_OUT``, else ``gpu-out`` in the working directory."""
    path = Path(os.environ.get("CMX_GPU_OUT", "gpu-out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def time_on_stream(fn: Callable[[], object], stream: Any, reps: int) -> float:
    """Seconds per call of ``fn`` issued on ``stream``, timed by CUDA events on that stream."""
    import torch

    with torch.cuda.stream(stream):
        fn()  # warm: allocator, first-touch, lazy module loads
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def write_table(name: str, header: list[str], rows: list[list[Any]], meta: dict[str, Any]) -> Path:
    """``name``.md (a markdown table) and ``name``.json in ``out_dir()``."""
    out = out_dir()
    lines = [f"| {' | '.join(header)} |", f"| {' | '.join('---' for _ in header)} |"]
    lines += [f"| {' | '.join(str(c) for c in row)} |" for row in rows]
    meta_lines = [f"- {k}: {v}" for k, v in meta.items()]
    (out / f"{name}.md").write_text("\n".join(lines + [""] + meta_lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps(
        {"header": header, "rows": rows, "meta": meta}, indent=1, default=str))
    return out / f"{name}.md"
