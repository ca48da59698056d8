"""What a non-editable install ships and provides.

The wheel is built from the repository's files (tracked and untracked-but-not-
ignored, copied to a temporary folder, as a clone would have them) with
``pip wheel --no-deps``. Building uses pip's isolated build environment, which
fetches ``setuptools`` from the package index exactly as the editable install
in CI's test command (``pip install -e ".[test]"``) already does; nothing else
is downloaded. The install check puts the wheel (``--no-deps``) into a fresh
virtual environment that sees this environment's torch through a ``.pth``
path entry (a plain path, so the editable install's finder there is not
loaded), and runs it from an empty folder.
"""

from __future__ import annotations

import email.parser
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]


# Where the installed package's modules come from: the pure passes live in the repository's
# top-level passes/ and are installed as fxsplit.passes (pyproject.toml's package-dir mapping).
INSTALLED_FROM = {"fxsplit/": "fxsplit/", "passes/": "fxsplit/passes/"}


def _repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (REPO / f).is_file()]


def _installed_modules() -> set[str]:
    """The package's modules as a wheel names them (``fxsplit/...py``), from the repository's files."""
    return {installed + f[len(src):] for f in _repo_files() if f.endswith(".py")
            for src, installed in INSTALLED_FROM.items() if f.startswith(src)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    src = tmp_path_factory.mktemp("src")
    for f in _repo_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    dist = tmp_path_factory.mktemp("dist")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    (whl,) = dist.glob("fxsplit-*.whl")
    return whl


def test_wheel_ships_only_the_fxsplit_package(wheel: pathlib.Path) -> None:
    import fxsplit

    names = zipfile.ZipFile(wheel).namelist()
    dist_info = f"fxsplit-{fxsplit.__version__}.dist-info/"
    stray = [n for n in names if not (n.startswith("fxsplit/") or n.startswith(dist_info))]
    assert stray == [], f"the wheel installs files outside fxsplit/: {stray}"
    # every module of the package is shipped (the bench, the passes, the CLI), and nothing else
    shipped = {n for n in names if n.startswith("fxsplit/")}
    in_repo = _installed_modules()
    assert shipped == in_repo, ("a subpackage missing from pyproject.toml's [tool.setuptools] packages?",
                                sorted(shipped ^ in_repo))
    assert {"fxsplit/cli.py", "fxsplit/bench/run.py", "fxsplit/bench/models.py", "fxsplit/passes/split.py",
            "fxsplit/_logging.py"} <= shipped
    top_level = zipfile.ZipFile(wheel).read(dist_info + "top_level.txt").decode().split()
    assert top_level == ["fxsplit"]


def test_wheel_metadata(wheel: pathlib.Path) -> None:
    import fxsplit

    z = zipfile.ZipFile(wheel)
    dist_info = f"fxsplit-{fxsplit.__version__}.dist-info/"
    eps = z.read(dist_info + "entry_points.txt").decode()
    assert "[console_scripts]\nfxsplit = fxsplit.cli:main" in eps
    assert "[torch_dynamo_backends]\nfxsplit = fxsplit.backend:fxsplit_backend" in eps
    meta = email.parser.Parser().parsestr(z.read(dist_info + "METADATA").decode())
    torch_req = [r for r in meta.get_all("Requires-Dist") if r.startswith("torch") and "extra ==" not in r]
    assert torch_req == ["torch<2.16,>=2.11"]


INSTALLED_CHECK = r'''
import os, sys
import torch
assert "fxsplit" not in sys.modules
be = torch._dynamo.lookup_backend("fxsplit")  # through the torch_dynamo_backends entry point
import fxsplit
assert be is sys.modules["fxsplit.backend"].fxsplit_backend, be
site = os.environ["EXPECT_SITE"]
assert fxsplit.__file__.startswith(site), (fxsplit.__file__, site)
import fxsplit.bench.run, fxsplit.passes, fxsplit._logging
print("installed ok", fxsplit.__version__)
'''


def test_installed_wheel_works_from_an_empty_folder(wheel: pathlib.Path, tmp_path: pathlib.Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = pathlib.Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    # torch and its dependencies from this environment: a path entry, not a site dir
    (site / "_deps_for_test.pth").write_text(str(pathlib.Path(torch.__file__).parents[1]) + "\n")
    before = set(os.listdir(site))
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    added = {n for n in set(os.listdir(site)) - before if n != "__pycache__"}
    assert added == {"fxsplit", wheel.name.split("-py3")[0] + ".dist-info"}, added

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCH_LOGS")}
    env["EXPECT_SITE"] = str(site)
    run = subprocess.run([str(py), "-c", INSTALLED_CHECK], cwd=empty, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "installed ok" in run.stdout

    # the console script runs the installed bench: a bad option is refused before anything is built
    fx = venv / "bin" / "fxsplit"
    run = subprocess.run([str(fx), "bench", "--reps", "0"], cwd=empty, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "--reps" in run.stderr, run.stderr[-2000:]
    assert list(empty.iterdir()) == []  # nothing written


EDITABLE_CHECK = r'''
import importlib.util
import fxsplit, fxsplit.passes
print(fxsplit.__file__)
print(fxsplit.passes.__file__)
print([name for name in ("passes", "benchmarks", "tests", "examples") if importlib.util.find_spec(name) is not None])
'''


def test_editable_install_maps_passes_and_installs_no_passes_name(tmp_path: pathlib.Path) -> None:
    """The editable install (CI's test command) imports ``fxsplit.passes`` from the top-level
    ``passes/`` directory, from any folder, and puts no other top-level name on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", EDITABLE_CHECK], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    fxsplit_file, passes_file, top_level = run.stdout.strip().splitlines()
    if pathlib.Path(fxsplit_file) != REPO / "fxsplit" / "__init__.py":
        pytest.skip(f"fxsplit is installed from {fxsplit_file}, not editable from this checkout")
    assert pathlib.Path(passes_file) == REPO / "passes" / "__init__.py"
    assert top_level == "[]"
