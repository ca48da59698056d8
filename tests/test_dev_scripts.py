"""The developer scripts README quotes figures from run and report what they say."""

from __future__ import annotations

import pytest

from benchmarks import kernel_profile


@pytest.mark.inductor
def test_kernel_profile_reports_both_backwards(capsys: pytest.CaptureFixture[str]) -> None:
    result = kernel_profile.main(["--model", "mlp", "--steps", "1", "--warmup", "1", "--rows", "3"])
    out = capsys.readouterr().out
    assert result["fused_ms"] > 0 and result["split_ms"] > 0
    assert "total self CPU ms per step" in out and "1 profiled steps" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "[input shapes]" in line)
    total = next(i for i, line in enumerate(lines) if line.startswith("total self CPU ms"))
    assert total - header - 1 == 3  # --rows


def test_kernel_profile_refuses_zero_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        kernel_profile.main(["--steps", "0"])
    assert e.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err
