"""Stops and crashes, injected for real in a subprocess: a preemption signal checkpoints and
exits 0, a second one exits at once, every rank stops together, and an unexpected failure or a
stop the run cannot answer still ends in bounded time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, last_checkpoint


def start(*argv) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fasttrain", *map(str, argv)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def wait_for_steps(out: Path, steps: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr.read()[-2000:]}")
        if path.is_file():
            done = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            if sum(r["kind"] == "train" for r in done) >= steps:
                return
        time.sleep(0.05)
    raise AssertionError("the run did not reach the step in time")


def common(tiny_data) -> list:
    return [
        "--data",
        tiny_data,
        *FAST,
        "--device",
        "cpu",
        "--max-steps",
        "30",
        "--eval-every",
        "0",
        "--log-every",
        "1",
    ]


@pytest.mark.slow
def test_sigterm_checkpoints_exits_0_and_resume_auto_ends_bitwise_equal(tiny_data, tmp_path):
    out = tmp_path / "preempted"
    proc = start(*common(tiny_data), "--output-dir", out)
    wait_for_steps(out, 5, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    stopped_at = last_checkpoint(out)["step"]
    assert 5 <= stopped_at < 30
    assert f"stopped by SIGTERM at step {stopped_at}" in (out / "log-rank0.txt").read_text()

    resumed = start(*common(tiny_data), "--output-dir", out, "--resume", "auto")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-2000:]
    ref = tmp_path / "straight"
    straight = start(*common(tiny_data), "--output-dir", ref)
    assert straight.wait(timeout=300) == 0, straight.stderr.read()[-2000:]
    a, b = last_checkpoint(out), last_checkpoint(ref)
    assert a["step"] == b["step"] == 30
    for k, v in b["model"].items():
        assert torch.equal(a["model"][k], v), k


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tiny_data, tmp_path):
    """A second signal more than a second after the first ends the process with 128 + the
    signal's number, not waiting for the step or a checkpoint (the same signal repeated within a
    second counts once). Steps are made slow (128 px, batch 48: seconds each on 2 cores) so the
    second signal lands inside the step the first one lets finish."""
    out = tmp_path / "twice"
    slow = ["--image-size", "128", "--batch-size", "48"]
    proc = start(*common(tiny_data), *slow, "--output-dir", out)
    wait_for_steps(out, 2, proc)
    proc.send_signal(signal.SIGINT)
    log = out / "log-rank0.txt"
    deadline = time.monotonic() + 60
    while "finishing the current step" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(1.2)  # past the repeat window
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 128 + signal.SIGINT
    assert "stopped by" not in log.read_text()


@pytest.mark.slow
def test_sigterm_to_a_two_process_run_checkpoints_every_rank_together(tiny_data, tmp_path):
    """The scheduler's way: SIGTERM to the whole process group (launcher and both ranks, which
    also get it forwarded by torch.distributed.run). The ranks agree at the next log step,
    rank 0 writes one checkpoint, and --resume auto continues from it."""
    out = tmp_path / "ddp-preempted"
    argv = ["--nproc-per-node", "2", *common(tiny_data), "--batch-size", "8", "--max-steps", "200"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fasttrain", *map(str, argv), "--output-dir", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wait_for_steps(out, 4, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert code == 128 + signal.SIGTERM and "--resume auto continues" in err, err[-2000:]
    stopped_at = last_checkpoint(out)["step"]
    assert 4 <= stopped_at < 200
    for rank in (0, 1):
        assert "SIGTERM: finishing the current step" in (out / f"log-rank{rank}.txt").read_text()
    assert f"stopped by SIGTERM at step {stopped_at}" in (out / "log-rank0.txt").read_text()


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
        ("fasttrain.step.step", "EagerStep", "__call__", "mid-epoch, train workers alive"),
        ("fasttrain.step.evaluate", "Evaluator", "_logits", "in evaluation, val workers alive"),
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


CLOSING = """
import os, signal, time
from fasttrain.run import faults
stop = faults.StopRequest()
stop.install()
os.kill(os.getpid(), signal.SIGINT)  # the first: a stop is requested
time.sleep(faults.REPEAT_WINDOW_S + 0.2)
stop.uninstall()  # the run closes: the checkpoint is written, the loaders stop
os.kill(os.getpid(), signal.SIGINT)  # a second signal while it closes
time.sleep(5)
"""


def test_a_second_signal_while_the_run_closes_still_exits_at_once():
    """Once a stop was requested, the run's close keeps the handler: the second signal ends the
    process with 128 + its number, as during the step, not by the signal's default action."""
    done = subprocess.run([sys.executable, "-c", CLOSING], capture_output=True, text=True)
    assert done.returncode == 128 + signal.SIGINT, done.stderr[-2000:]
