"""Run tests/gpu without pytest (a GPU machine may lack it): every ``test_*`` function of
every ``test_*.py`` here, in file order; a failure prints its traceback; exit 1 if any failed.

    python tests/gpu/standalone.py
"""

from __future__ import annotations

import importlib.util
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    sys.path.insert(0, str(HERE))
    import torch

    if not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}): nothing to run")
        return 0
    failed = 0
    for path in sorted(HERE.glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name in sorted(n for n in vars(module) if n.startswith("test_")):
            t0 = time.perf_counter()
            try:
                getattr(module, name)()
                verdict = "PASS"
            except Exception:  # noqa: BLE001 - every failure is reported, then the next runs
                verdict = "FAIL"
                failed += 1
                traceback.print_exc()
            print(f"{verdict} {path.name}::{name} ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
