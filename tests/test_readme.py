"""README's example (compile, B, W) runs and prints the output README shows.

The example compiles with the real Inductor (``backend="fxsplit"``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks_after(heading: str) -> list[str]:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.findall(r"```(?:python|)\n(.*?)```", section, flags=re.S)[:2]


@pytest.mark.inductor
def test_readme_example_prints_what_readme_shows() -> None:
    code, shown = _blocks_after("## Example: compile, B, W")
    assert len(code.strip().splitlines()) == 10
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines() == shown.strip().splitlines()
