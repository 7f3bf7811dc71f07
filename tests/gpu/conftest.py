"""tests/gpu runs where CUDA is present; elsewhere (CI has no GPU) each test skips, saying why.

``test_imports.py`` runs everywhere: it checks that what the GPU machine imports needs none of
what it lacks. The other skips in the tests are listed in docs/GPU.md.
"""

from __future__ import annotations

import pytest

ALWAYS = {"test_imports.py"}


def _cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__}): tests/gpu runs on a GPU machine"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _cuda_missing()
    if reason is None:
        return
    for item in items:
        if item.path.parent.name == "gpu" and item.path.name not in ALWAYS:
            item.add_marker(pytest.mark.skip(reason=reason))
