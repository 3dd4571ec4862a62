"""The fake-CUDA tier: the project's CUDA branches on a CPU-only torch (tests/fakecuda/harness.py says how)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakecuda.harness import FakeCuda, install

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.fakecuda)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """An 8-device A100 node's CUDA runtime, faked for this test (the main thread's current device is 0)."""
    with install(FakeCuda(8), monkeypatch) as fc:
        yield fc
