"""Bad flags, recipes and launches: one line naming the flag or file and what to do, exit 2,
no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST
from tests.faults.conftest import one_line_error


def test_bad_config_key_and_value(run, tiny_data, tmp_path):
    for text, expected in [
        ("train:\n  batchsize: 3\n", "unknown key 'train.batchsize'"),
        ("optim:\n  lr: fast\n", "optim.lr: expected a number"),
    ]:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(text)
        code, err = run("--config", recipe, "--data", tiny_data)
        assert code == 2
        line = one_line_error(err)
        assert expected in line and str(recipe) in line


def test_missing_config_file(run, tmp_path):
    code, err = run("--config", tmp_path / "nope.yaml")
    assert code == 2 and "--config" in one_line_error(err) and "not found" in err


def test_batch_size_below_one(run, tiny_data):
    code, err = run("--data", tiny_data, "--batch-size", "0")
    assert code == 2 and "--batch-size must be at least 1 (got 0)" in one_line_error(err)


def test_unknown_flag_and_bad_choice_exit_2(run, tiny_data):
    for argv in (["--bogus"], ["--arch", "vgg16"], ["--amp", "fp8"]):
        with pytest.raises(SystemExit) as e:
            run("--data", tiny_data, *argv)
        assert e.value.code == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "nan"], "--lr: expected a finite number, got nan"),
        (["--lr", "inf"], "--lr: expected a finite number, got inf"),
        (["--warmup-epochs", "nan"], "--warmup-epochs: expected a finite number, got nan"),
        (["--seed", "-1"], "--seed must be at least 0 (got -1)"),
        (["--seed", "4294967296"], "--seed must be at most 4.29497e+09 (got 4294967296)"),
        (["--label-smoothing", "5"], "--label-smoothing must be at most 1 (got 5.0)"),
    ],
)
def test_values_out_of_bounds_are_one_line_and_exit_2(run, tmp_path, flags, message):
    code, err = run("--data", tmp_path, *FAST, *flags)
    assert code == 2 and err.strip() == f"fasttrain: error: {message}"
    assert not list(tmp_path.glob("runs*"))


def test_a_nan_in_a_recipe_is_refused(run, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: .nan\n")
    code, err = run("--config", recipe, "--data", tmp_path, *FAST)
    assert code == 2 and err.strip() == f"fasttrain: error: {recipe}: optim.lr: expected a " \
        "finite number, got nan"  # fmt: skip


def test_a_binary_config_is_one_line(run, tmp_path):
    recipe = tmp_path / "model.pt"
    recipe.write_bytes(bytes(range(256)) * 4)
    code, err = run("--config", recipe, "--data", tmp_path, *FAST)
    assert code == 2
    assert (
        one_line_error(err)
        == f"fasttrain: error: --config {recipe}: not a YAML text file (not UTF-8 text)"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
        (["--epochs", "many"], "argument --epochs: invalid int value: 'many'"),
    ],
)
def test_a_usage_error_is_one_line_with_a_pointer_to_help(argv, message):
    done = subprocess.run(
        [sys.executable, "-m", "fasttrain", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"python -m fasttrain: error: {message}")
    assert lines[0].endswith("(see python -m fasttrain --help)")


def test_help_answers_without_importing_torch():
    code = (
        "import io, sys, time, contextlib\n"
        "t = time.perf_counter()\n"
        "from fasttrain.__main__ import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    assert main(['--help']) == 0\n"
        "print('torch' in sys.modules, '--cuda-graphs' in out.getvalue(), time.perf_counter() - t)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    torch_loaded, complete, seconds = done.stdout.split()
    assert (torch_loaded, complete) == ("False", "True"), done.stderr
    assert float(seconds) < 2.0  # torch's import alone takes seconds on a small machine


def test_world_size_without_a_rendezvous_says_how_to_launch(run, tiny_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    code, err = run("--data", tiny_data, *FAST)
    line = one_line_error(err)
    assert code == 2 and "WORLD_SIZE=2 without MASTER_ADDR" in line and "--nproc-per-node" in line


def test_bad_nproc_per_node_is_one_line(run):
    code, err = run("--nproc-per-node", "zero", "--device", "cpu")
    assert code == 2 and "--nproc-per-node 'zero'" in one_line_error(err)


def test_cli_process_prints_no_traceback(tmp_path):
    """The real entry point, in a fresh interpreter: exit code 2, one line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "fasttrain", "--data", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"fasttrain: error: --data {tmp_path / 'none'}: no such directory; point it at a folder "
        "with train/ and val/ inside, or leave --data out to use the built-in sample dataset"
    ]


class _Runs:
    """An object whose unpickling would run code (it creates ``marker``)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("how", ["--weights", "evaluate", "--resume"])
def test_a_file_that_needs_code_to_load_is_refused_without_advice_to_load_it_unsafely(
    run, tiny_data, tmp_path, how
):
    """A weights file or checkpoint that pickles an object: refused in one line that says
    fasttrain loads weights only, never torch's advice to load with weights_only=False, and the
    object's code never runs."""
    marker = tmp_path / "code-ran"
    bad = tmp_path / "bad.pt"
    torch.save({"model": {"fc.weight": torch.zeros(4, 2)}, "payload": _Runs(str(marker))}, bad)
    common = ["--data", tiny_data, *FAST, "--max-steps", "1", "--output-dir", tmp_path / "o"]
    argv = {
        "--weights": [*common, "--weights", bad],
        "evaluate": ["evaluate", bad, "--data", tiny_data, *FAST, "--output-dir", tmp_path / "o"],
        "--resume": [*common, "--resume", bad],
    }[how]
    code, err = run(*argv)
    assert code == 2, err
    line = one_line_error(err)
    assert "need code to load" in line and "fasttrain loads weights only" in line
    assert "weights_only" not in err and "Re-running" not in err
    assert not marker.exists()
