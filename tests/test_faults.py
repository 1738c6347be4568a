"""What a hostile user or machine does to a run, through the CLI: it ends in bounded time, bad
values are one line with exit 2, and an unexpected failure keeps its traceback and names the log."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import FAST

# A fault injected into a real run: the named method raises on its Nth call. The run starts in a
# subprocess through fasttrain's own entry point, so the exit (and what could hang it) is real.
INJECT = """
import sys
from {module} import {cls} as target
calls = [0]
original = target.{method}

def failing(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == {call}:
        raise RuntimeError("injected fault")
    return original(self, *args, **kwargs)

target.{method} = failing
sys.argv = ["fasttrain", *{argv!r}]
from fasttrain.__main__ import entry
entry()
"""


def run_injected(module, cls, method, call, argv, timeout=120):
    code = textwrap.dedent(INJECT).format(
        module=module, cls=cls, method=method, call=call, argv=[str(a) for a in argv]
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, cls, method, where",
    [
        ("fasttrain.step", "EagerStep", "__call__", "mid-epoch, train workers alive"),
        ("fasttrain.evaluate", "Evaluator", "_logits", "in evaluation, val workers alive"),
    ],
)
def test_an_unexpected_failure_exits_in_bounded_time_with_its_traceback(
    tiny_data, tmp_path, module, cls, method, where
):
    """Loader workers ignore SIGTERM (so a scheduler's signal cannot kill the step the main
    process finishes before its checkpoint); Python's exit used to wait on them forever after a
    failure. The trainer now shuts them down itself, and a watchdog bounds the exit."""
    out = tmp_path / "run"
    argv = ["--data", tiny_data, *FAST, "--workers", "2", "--epochs", "2", "--output-dir", out]
    call = 5 if cls == "EagerStep" else 2
    done, seconds = run_injected(module, cls, method, call, argv)
    assert done.returncode == 1, (where, done.stderr[-2000:])
    assert seconds < 60, where  # it used to hang until killed
    assert "RuntimeError: injected fault" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "fasttrain: error: an unexpected failure, traceback above; the run's log is "
        f"{out / 'log-rank0.txt'}"
    )
    assert "injected fault" in (out / "log-rank0.txt").read_text()


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


def test_a_run_branching_from_an_older_step_keeps_its_own_checkpoints(run, tiny_data, tmp_path):
    """Resume from a copy of step 3 into a folder that still holds the abandoned run's step 6,
    keeping one checkpoint: the new checkpoints survive pruning, the abandoned ones move aside
    (so --resume auto takes the new lineage), and a dead writer's temporary file goes."""
    from fasttrain.run import checkpoint as ckpt

    out = tmp_path / "run"
    flags = ["--data", tiny_data, *FAST, "--eval-every", "0", "--output-dir", out]
    code, err = run(*flags, "--max-steps", "6", "--ckpt-every-steps", "3")
    assert code == 0, err
    branch = tmp_path / "step3.pt"
    branch.write_bytes((out / "ckpt-00000003.pt").read_bytes())
    (out / ".ckpt-00000007.pt.tmp-4242").write_bytes(b"half a checkpoint")
    code, err = run(
        *flags, "--max-steps", "8", "--ckpt-every-steps", "1", "--keep-checkpoints", "1",
        "--resume", branch,
    )  # fmt: skip
    assert code == 0, err
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["ckpt-00000008.pt"]
    (aside,) = out.glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["ckpt-00000006.pt"]
    assert not list(out.glob(".ckpt-*.tmp-*"))
    log = (out / "log-rank0.txt").read_text()
    assert "this run starts at step 3" in log and "ckpt-00000006.pt" in log
    assert ckpt.latest_valid(out)[1]["step"] == 8


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("fasttrain: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _copy(tiny_data, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data, symlinks=True)
    return data


@pytest.mark.parametrize("where", ["file", "class folder"])
def test_a_symlink_loop_in_the_data_is_one_line(run, tiny_data, tmp_path, where):
    data = _copy(tiny_data, tmp_path)
    link = data / "train" / "class_000" / "loop.jpg" if where == "file" else data / "train" / "x"
    link.symlink_to(link.name)  # points at itself
    code, err = run("--data", data, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert _one_line(err) == (
        f"fasttrain: error: --data: cannot read {link} (Too many levels of symbolic links); "
        "fix it (permissions, links) or move it out of the dataset"
    )


def test_an_unreadable_class_folder_is_one_line(run, tiny_data, tmp_path, monkeypatch):
    """(Permissions cannot be taken from root, which CI runs as: the refusal is simulated.)"""
    import errno

    data = _copy(tiny_data, tmp_path)
    locked = data / "val" / "class_001"
    scandir = os.scandir

    def refuse(path="."):
        if os.fspath(path) == os.fspath(locked):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(locked))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    code, err = run("--data", data, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert f"cannot read {locked} (Permission denied)" in _one_line(err)


def test_a_single_class_dataset_is_refused(run, tiny_data, tmp_path):
    import shutil

    data = _copy(tiny_data, tmp_path)
    for split in ("train", "val"):
        for extra in sorted((data / split).iterdir())[1:]:
            shutil.rmtree(extra)
    code, err = run("--data", data, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert _one_line(err) == (
        f"fasttrain: error: --data {data}/train: one class folder (class_000); a classifier "
        "needs at least two classes"
    )


def test_a_binary_config_is_one_line(run, tmp_path):
    recipe = tmp_path / "model.pt"
    recipe.write_bytes(bytes(range(256)) * 4)
    code, err = run("--config", recipe, "--data", tmp_path, *FAST)
    assert code == 2
    assert (
        _one_line(err)
        == f"fasttrain: error: --config {recipe}: not a YAML text file (not UTF-8 text)"
    )


@pytest.mark.slow
def test_resuming_another_architecture_is_one_line(run, tiny_data, tmp_path):
    out = tmp_path / "r18"
    flags = ["--data", tiny_data, *FAST, "--eval-every", "0", "--max-steps", "2"]
    code, err = run(*flags, "--output-dir", out)
    assert code == 0, err
    ckpt_path = out / "ckpt-00000002.pt"
    code, err = run(*flags, "--arch", "resnet34", "--output-dir", tmp_path / "r34",
                    "--max-steps", "4", "--resume", ckpt_path)  # fmt: skip
    assert code == 2
    line = _one_line(err)
    assert line.startswith(
        f"fasttrain: error: --resume {ckpt_path}: its model (resnet18, 4 classes) does not fit "
        "this run's (resnet34, 4 classes): "
    )
    assert line.endswith(
        "resume with the checkpoint's --arch and --num-classes, or start without --resume"
    )


def test_both_loaders_apply_exif_orientation(tmp_path):
    """A phone photo stored sideways with an EXIF orientation tag: the torchvision loader and
    DALI see the picture a viewer shows (left half red turned to the top half here)."""
    import numpy as np
    import torch
    from PIL import Image

    from fasttrain.data.folder import scan_folder

    pytest.importorskip("nvidia.dali")
    from fasttrain.data.dali import DaliLoader
    from fasttrain.data.torchvision import build_torchvision_loader

    pixels = np.zeros((64, 96, 3), np.uint8)
    pixels[:, :48, 0] = 255  # left half red, right half blue
    pixels[:, 48:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(pixels).save(tmp_path / split / c / "photo.jpg", exif=exif)
    samples = scan_folder(tmp_path).val
    common = dict(train=False, image_size=32, batch_size=2, seed=0, rank=0, world=1,
                  device=torch.device("cpu"), channels_last=True)  # fmt: skip
    tv = build_torchvision_loader(samples, workers=0, dtype=torch.float32, **common)
    dali = DaliLoader(samples, threads=1, hw_decoder_load=0.99, local_rank=0, **common)
    for loader in (tv, dali):
        loader.set_epoch(0)
        x, _ = next(iter(loader))
        red = x[0, 0].float()
        assert red[:12].mean() > 1 and red[-12:].mean() < -1, type(loader).__name__
        assert abs(red[:, :12].mean() - red[:, -12:].mean()) < 0.2, type(loader).__name__


def test_check_data_lists_any_file_name_and_dali_then_trains_past_it(run, tiny_data, tmp_path):
    """A zero-byte file whose name holds a newline: check-data's list names it exactly (one JSON
    document), and the DALI loader, which would stop on it, trains past it."""
    import json

    pytest.importorskip("nvidia.dali")
    from fasttrain.__main__ import main
    from fasttrain.data.check import read_exclude_list

    data = _copy(tiny_data, tmp_path)
    odd = data / "train" / "class_001" / "bad\nname.jpg"
    odd.write_bytes(b"")
    listed = tmp_path / "bad.json"
    assert main(["check-data", str(data), "--workers", "1", "--output", str(listed)]) == 0
    document = json.loads(listed.read_text())
    assert [f["path"] for f in document["files"]] == [str(odd)]
    assert read_exclude_list(listed) == {str(odd)}
    code, err = run(
        "--data", data, *FAST, "--loader", "dali", "--dali-threads", "1", "--max-steps", "3",
        "--eval-every", "0", "--exclude-list", listed, "--output-dir", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    assert "leaving out the 1 files" in (tmp_path / "o" / "log-rank0.txt").read_text()


def test_a_hand_written_exclusion_list_is_one_path_per_line(tmp_path):
    from fasttrain.data.check import read_exclude_list

    listed = tmp_path / "skip.txt"
    listed.write_text("# broken ones\n/data/a.jpg\n\n/data/b c.jpg\n")
    assert read_exclude_list(listed) == {"/data/a.jpg", "/data/b c.jpg"}


def test_dalis_reader_failing_on_a_zero_byte_file_is_one_line_naming_it(run, tiny_data, tmp_path):
    pytest.importorskip("nvidia.dali")
    data = _copy(tiny_data, tmp_path)
    empty = data / "train" / "class_001" / "zero.jpg"
    empty.write_bytes(b"")
    code, err = run(
        "--data", data, *FAST, "--loader", "dali", "--dali-threads", "1", "--epochs", "1",
        "--eval-every", "0", "--output-dir", tmp_path / "o",
    )  # fmt: skip
    assert code == 1, err
    assert _one_line(err).startswith(
        f"fasttrain: error: --loader dali: DALI cannot read {empty} (File mapping failed); run "
        "`python -m fasttrain check-data DIR` once"
    )


PAUSED_EVAL = """
import sys, time
from pathlib import Path
import fasttrain.run.watchdog
from fasttrain.step.evaluate import Evaluator
fasttrain.run.watchdog.STOP_BOUND_S = {stop_bound}
original = Evaluator._logits

def paused(self, *args, **kwargs):
    marker = Path({marker!r})
    if not marker.exists():
        marker.write_text("evaluating")
        time.sleep({pause})
    return original(self, *args, **kwargs)

Evaluator._logits = paused
sys.argv = ["fasttrain", *{argv!r}]
from fasttrain.__main__ import entry
entry()
"""


def start_paused_in_eval(tmp_path, argv, pause: float, stop_bound: float = 600.0, **popen):
    """A run in a subprocess whose first evaluation pauses ``pause`` seconds; returned once it
    is in that pause (``STOP_BOUND_S`` set to ``stop_bound``)."""
    marker = tmp_path / "evaluating"
    code = textwrap.dedent(PAUSED_EVAL).format(
        marker=str(marker), argv=[str(a) for a in argv], pause=pause, stop_bound=stop_bound
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        **popen,
    )
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), proc.stderr.read()[-2000:]
    return proc


@pytest.mark.slow
def test_sigterm_to_the_process_group_during_evaluation_checkpoints_and_exits(tiny_data, tmp_path):
    """The scheduler's SIGTERM reaches every process of the group while val workers are busy:
    the workers ignore it, the run finishes the evaluation, checkpoints and exits 0, in bounded
    time."""
    import json
    import signal

    out = tmp_path / "run"
    argv = ["--data", tiny_data, *FAST, "--workers", "2", "--epochs", "3", "--output-dir", out]
    proc = start_paused_in_eval(tmp_path, argv, pause=3, start_new_session=True)
    os.killpg(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    assert time.monotonic() - t0 < 60
    log = (out / "log-rank0.txt").read_text()
    assert "stopped by SIGTERM" in log
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps and list(out.glob("ckpt-*.pt"))


def test_a_class_whose_every_image_fails_is_named(run, tiny_data, tmp_path):
    """The torchvision loader skips bad files one by one; when a whole class is gone it says
    so, by name. With check-data's list the run refuses to start instead."""
    data = _copy(tiny_data, tmp_path)
    for path in (data / "train" / "class_002").iterdir():
        path.write_bytes(b"not an image")
    code, err = run(
        "--data", data, *FAST, "--loader", "torchvision", "--workers", "0", "--epochs", "1",
        "--eval-every", "0", "--output-dir", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    log = (tmp_path / "o" / "log-rank0.txt").read_text()
    assert "every image of class class_002 (48 files) failed to decode" in log
    from fasttrain.__main__ import main

    listed = tmp_path / "bad.json"
    assert (
        main(["check-data", str(data), "--workers", "1", "--no-dali", "--output", str(listed)]) == 0
    )
    code, err = run("--data", data, *FAST, "--exclude-list", listed, "--output-dir", tmp_path / "p")
    assert code == 2
    assert (
        f"every image in class folder {data}/train/class_002 is on the exclusion list"
        in _one_line(err)
    )


@pytest.mark.slow
def test_a_stop_request_the_run_cannot_answer_ends_by_the_watchdog(tiny_data, tmp_path):
    """After SIGTERM the run has a bounded time to checkpoint and leave; a run stuck past it
    (here an evaluation that never returns) prints every thread's stack and exits 1."""
    import signal

    argv = ["--data", tiny_data, *FAST, "--epochs", "2", "--output-dir", tmp_path / "run"]
    proc = start_paused_in_eval(tmp_path, argv, pause=120, stop_bound=3.0)  # stuck for good
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert proc.wait(timeout=60) == 1
    assert time.monotonic() - t0 < 30
    err = proc.stderr.read()
    assert "Timeout (0:00:03)!" in err and "in paused" in err


def test_resuming_a_finished_run_changes_nothing(run, tiny_data, tmp_path):
    out = tmp_path / "done"
    flags = ["--data", tiny_data, *FAST, "--max-steps", "4", "--eval-every", "0",
             "--output-dir", out]  # fmt: skip
    code, err = run(*flags)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, err = run(*flags, "--resume", "auto")
    assert code == 0, err
    assert "is the end of this run (step 4); nothing to train, nothing changed" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_resume_auto_without_an_output_dir_continues_the_newest_run_of_the_config(
    run, tiny_data, tmp_path, monkeypatch
):
    """An unnamed run goes to runs/<time>; the stop hint names it, and --resume auto alone
    finds it again (a run of another config beside it is left alone)."""
    monkeypatch.chdir(tmp_path)
    flags = ["--data", tiny_data, *FAST, "--eval-every", "0", "--epochs", "1"]
    code, err = run(*flags, "--max-steps", "2")
    assert code == 0, err
    (first,) = (tmp_path / "runs").iterdir()
    code, err = run(*flags, "--max-steps", "2", "--lr", "0.2", "--output-dir", "runs/other")
    assert code == 0, err
    code, err = run(*flags, "--max-steps", "4", "--resume", "auto")
    assert code == 0, err
    assert f"--resume auto: continuing runs/{first.name}, the newest run of this config" in err
    log = (first / "log-rank0.txt").read_text()
    assert "resumed from" in log and "done: steps 2-4 in" in log
    import json

    summary = json.loads((first / "summary.json").read_text())
    assert (summary["start_step"], summary["steps"]) == (2, 4)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([first.name, "other"])


def test_the_cpu_log_speaks_of_processes_and_leaves_gpu_memory_out(run, tiny_data, tmp_path):
    out = tmp_path / "cpu"
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "2", "--eval-every", "0",
                    "--output-dir", out)  # fmt: skip
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert "global batch 16 (16 per process x 1 process x 1 accum)" in log
    assert "GPU" not in log and "peak memory" not in log
    import json

    assert json.loads((out / "summary.json").read_text())["peak_mem_gib"] is None


def test_env_writes_cudnns_version_as_it_is_written():
    from fasttrain.envreport import _cudnn_version

    assert _cudnn_version(92400) == "9.24.0" and _cudnn_version(91900) == "9.19.0"
    assert _cudnn_version(8907) == "8.9.7"


def test_a_start_that_fails_leaves_no_run_folder(run, tiny_data, tmp_path, monkeypatch):
    """A run folder is created for the run, and removed again if the run cannot start; a folder
    the user named and that existed before stays."""
    import shutil

    monkeypatch.chdir(tmp_path)
    data = _copy(tiny_data, tmp_path)
    shutil.rmtree(data / "val")
    code, err = run("--data", data, *FAST)
    assert code == 2 and "no val/ folder" in _one_line(err)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    code, err = run("--data", data, *FAST, "--output-dir", mine)
    assert code == 2 and mine.is_dir()


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
