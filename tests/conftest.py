"""Shared pytest setup for the fxsplit suite.

* Every test starts with a fresh Dynamo state (``torch._dynamo.reset()``), so
  compiled regions, recompile counters and automatic-dynamic decisions do not
  leak between tests, and with ``torch.manual_seed(0)``.
* Tests that compile with the real Inductor are marked ``inductor``
  (``pytest -m "not inductor"`` skips the slow C++ compiles while iterating).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "inductor: compiles with the real Inductor (C++ on CPU); slower")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
