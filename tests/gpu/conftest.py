"""The GPU tier: every test here needs a CUDA device. Without one each is skipped with the reason (pytest -ra
prints it); CI here has no GPU, so this tier only runs where an accelerator is available."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device: the gpu tier runs only where torch.cuda.is_available() (here: " + (
    "a CPU-only torch build)" if torch.version.cuda is None else "no visible GPU)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))
