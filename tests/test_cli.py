"""``fxsplit bench`` options: every bad one is a one-line error (exit status 2) before anything is built.

These run the command line in-process with the benchmark itself replaced by a
function that fails the test if reached, and ``torch.compile`` likewise.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from fxsplit import cli
from fxsplit.bench import allocator, settings
from fxsplit.bench import run as bench
from fxsplit.bench.models import MODELS


@pytest.fixture(autouse=True)
def _nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark started although an option was bad")

    monkeypatch.setattr(bench, "run", refuse)
    monkeypatch.setattr(torch, "compile", refuse)


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("fxsplit bench: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--reps", "0"], "--reps must be at least 1, got 0"),
        (["--reps", "-3"], "--reps"),
        (["--reps", "many"], "--reps"),
        (["--compile-reps", "0"], "--compile-reps must be at least 1, got 0"),
        (["--batch", "0"], "--batch must be at least 1"),
        (["--seq", "-1"], "--seq"),
        (["--layers", "0"], "--layers"),
        (["--dim", "0"], "--dim"),
        (["--device", "tpu"], "--device 'tpu' is not a device"),
        (["--device", "mps"], "cpu or cuda"),
        (["--device", "cuda:banana"], "--device"),
        (["--dtype", "int8"], "--dtype"),
        (["--dtype", "float64"], "--dtype"),
        (["--model", "resnet"], "--model"),
        (["--dim", "31"], "dim (31) must be a multiple of heads (4)"),
        (["--quick", "--dim", "31"], "dim (31) must be a multiple of heads (2)"),
        (["--model", "mlp", "--embedding"], "--embedding applies to --model gpt only"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["--malloc", "jemalloc"], "--malloc"),
    ],
)
def test_bad_option_is_one_line_error(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert names in _error(argv, capsys)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda(device: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA is not available" in _error(["--device", device], capsys)


def test_out_is_a_directory(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "is a directory" in _error(["--out", str(tmp_path)], capsys)


def test_out_cannot_be_written(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "cannot create" in _error(["--out", str(blocker / "results.json")], capsys)


def test_quick_never_overwrites_a_full_run(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"settings": {"quick": False}, "modes": []}))
    assert "holds the results of a full run" in _error(["--quick", "--out", str(full)], capsys)
    assert json.loads(full.read_text()) == {"settings": {"quick": False}, "modes": []}


def test_quick_has_its_own_default_file() -> None:
    parser = cli.build_bench_parser()
    full = settings.settings_from_args(parser.parse_args(["--device", "cpu"]), parser)
    quick = settings.settings_from_args(parser.parse_args(["--device", "cpu", "--quick"]), parser)
    assert full.out is not None and quick.out is not None
    assert quick.out.parent == full.out.parent
    assert quick.out.name == full.out.stem + "-quick.json"
    mlp = settings.settings_from_args(parser.parse_args(["--device", "cpu", "--quick", "--model", "mlp"]), parser)
    assert mlp.out is not None and mlp.out.name.endswith("-mlp-quick.json")


def test_model_choices_are_the_registered_models() -> None:
    action = next(a for a in cli.build_bench_parser()._actions if a.dest == "model")
    assert list(action.choices) == sorted(MODELS)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_has_valid_default_and_quick_settings(model: str) -> None:
    parser = cli.build_bench_parser()
    for extra in ([], ["--quick"]):
        s = settings.settings_from_args(parser.parse_args(["--device", "cpu", "--model", model, *extra]), parser)
        assert s.model.name == model and s.reps >= 1


def test_top_level_command_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "invalid choice: 'no-such-command'" in err[0]
    assert cli.main([]) == 2


def test_malloc_retain_is_cpu_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert "applies to --device cpu only" in _error(["--device", "cuda", "--malloc", "retain"], capsys)


def test_malloc_retain_needs_glibc(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    assert "--malloc retain: it needs glibc's malloc" in _error(["--device", "cpu", "--malloc", "retain"], capsys)


def test_malloc_retain_has_its_own_default_file() -> None:
    parser = cli.build_bench_parser()
    full = settings.settings_from_args(parser.parse_args(["--device", "cpu", "--model", "llama"]), parser)
    if allocator.glibc_problem() is not None:
        pytest.skip(f"--malloc retain cannot run here: {allocator.glibc_problem()}")
    kept = settings.settings_from_args(parser.parse_args(["--device", "cpu", "--model", "llama", "--malloc", "retain"]),
                                    parser)
    assert full.malloc == "default" and kept.malloc == "retain"
    assert full.out is not None and kept.out is not None
    assert kept.out.name == full.out.stem + "-malloc-retain.json"


def test_host_bound_configuration() -> None:
    """--host-bound: the issue's tiny stage (width 128, 2 x 64 tokens, 2 layers) on any device, with a file of its own."""
    parser = cli.build_bench_parser()
    s = settings.settings_from_args(parser.parse_args(["--device", "cpu", "--host-bound"]), parser)
    assert (s.model.dim, s.model.batch, s.model.seq, s.model.layers) == (128, 2, 64, 2) and s.host_bound
    assert s.out is not None and s.out.name.endswith("-host-bound.json")
    s = settings.settings_from_args(parser.parse_args(["--device", "cpu", "--host-bound", "--model", "llama"]), parser)
    assert s.model.name == "llama" and s.model.dim == 128 and s.out.name.endswith("-llama-host-bound.json")


def test_host_bound_refuses_quick_and_conv(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--host-bound and --quick" in _error(["--device", "cpu", "--host-bound", "--quick"], capsys)
    assert "--host-bound applies to" in _error(["--device", "cpu", "--host-bound", "--model", "conv"], capsys)
