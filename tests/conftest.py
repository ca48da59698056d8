"""Shared pytest setup for the fxsplit suite.

* The whole suite runs with ``fallback="error"``: ``FXSPLIT_FALLBACK=error``
  in the environment (so spawned pipelining ranks inherit it) and
  ``fxsplit.config.fallback = "error"``, which every backend without an
  explicit ``fallback=`` follows, the plain ``backend="fxsplit"`` string
  included. A region that cannot be compiled raises instead of passing
  through an eager fallback; only tests of the fallback itself ask for
  ``fallback="eager"``, and every other test fails if a fallback was recorded.
* Every test starts with a fresh Dynamo state (``torch._dynamo.reset()``), so
  compiled regions, recompile counters and automatic-dynamic decisions do not
  leak between tests, and with ``torch.manual_seed(0)``.
* Tests that compile with the real Inductor are marked ``inductor``
  (``pytest -m "not inductor"`` skips the slow C++ compiles while iterating).
* Where pytest-xdist is installed, the suite runs on two worker processes,
  a test file per worker at a time (``--dist loadfile``), unless ``-n`` says
  otherwise: ``-n 0`` runs in this process (one test, ``--pdb``).
"""

from __future__ import annotations

import os

os.environ["FXSPLIT_FALLBACK"] = "error"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402

try:
    import fxsplit  # noqa: E402
except ImportError as e:
    if "fxsplit.passes" not in str(e):
        raise
    # The pure passes live in the repository's top-level passes/, installed as fxsplit.passes
    # through a package-dir mapping that an editable install records when it is made.
    raise ImportError(
        f"{e}: fxsplit.passes lives in passes/ (installed as fxsplit.passes). Re-run "
        "`.venv/bin/pip install -e .` if this venv was installed before passes/ moved out of fxsplit/, "
        "and delete a leftover fxsplit/passes/ directory (git leaves its __pycache__ behind)") from e

fxsplit.config.fallback = "error"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-n", type=int, default=None,
        help="seeds tests/test_differential.py runs (default: FXSPLIT_FUZZ_N, else 20)",
    )


# The suite's own default: two workers, each test file on one of them (its module-scoped
# multi-rank worlds run once), wherever pytest-xdist is installed (README's test command
# installs it) and the command line chose nothing. ``-n 0`` runs in this process (a single
# test, ``--pdb``); ``-n N`` picks N workers.
DEFAULT_WORKERS = 2


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if getattr(config.option, "numprocesses", 0) is None and not config.option.usepdb \
            and not config.option.collectonly:
        config.option.numprocesses = DEFAULT_WORKERS
        if config.option.dist == "no":
            config.option.dist = "loadfile"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "inductor: compiles with the real Inductor (C++ on CPU); slower")
    config.addinivalue_line(
        "markers", "fallback: a test of the eager fallback itself (it may record fallbacks)"
    )
    config.addinivalue_line(
        "markers", "slow: a large multi-process run (8 ranks); runs by default, `-m \"not slow\"` leaves it out"
    )
    config.addinivalue_line(
        "markers", "cuda: the CUDA tier (tests/test_cuda.py): needs a CUDA device and skips, saying so, without one"
    )


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_silent_fallback(request: pytest.FixtureRequest) -> None:
    """Fail any test (but the fallback tests) during which a region fell back to eager."""
    before = len(fxsplit.fallbacks())
    yield
    if request.node.get_closest_marker("fallback") is None:
        new = fxsplit.fallbacks()[before:]
        assert not new, f"regions fell back to eager: {[str(r) for r in new]}"
