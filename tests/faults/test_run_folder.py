"""Two runs in one folder: a run holds its folder's lock from before it writes anything to its
exit; a second run is one line naming the holder; a lock left by a killed run on this host is
taken over, saying so; one held from another host is taken only with --break-lock."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fasttrain.run.lock import NAME, Holder, RunLock, process_started
from tests.conftest import FAST
from tests.faults.conftest import one_line_error


def start_long_run(tiny_data, out: Path) -> subprocess.Popen:
    """A CPU run in a process of its own that trains long enough to be met while it runs."""
    return subprocess.Popen(
        [sys.executable, "-m", "fasttrain", "--data", str(tiny_data), *FAST, "--epochs", "50",
         "--eval-every", "0", "--log-every", "1", "--output-dir", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def wait_for_training(out: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until the run holds its lock and has trained a step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr.read()[-2000:]}")
        if (out / NAME).is_file() and (out / "metrics.jsonl").is_file():
            return
        time.sleep(0.1)
    raise AssertionError("the run did not start training in time")


@pytest.mark.slow
def test_a_second_run_in_a_held_folder_is_one_line_naming_the_holder(run, tiny_data, tmp_path):
    out = tmp_path / "run"
    first = start_long_run(tiny_data, out)
    try:
        wait_for_training(out, first)
        holder = json.loads((out / NAME).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        for extra in ([], ["--resume", "auto"]):
            code, err = run("--data", tiny_data, *FAST, "--max-steps", "2", "--output-dir", out,
                            *extra)  # fmt: skip
            assert code == 2, err
            line = one_line_error(err)
            assert f"--output-dir {out}: another run holds it (process {first.pid} on" in line
            assert "wait for it to end, or choose another --output-dir or --name" in line
        assert first.poll() is None  # the first run goes on, untouched
    finally:
        first.terminate()
        first.wait(timeout=120)
    assert not (out / NAME).exists()  # released as the first run stopped


@pytest.mark.slow
def test_a_lock_left_by_a_killed_run_is_taken_over_saying_so(run, tiny_data, tmp_path):
    out = tmp_path / "run"
    first = start_long_run(tiny_data, out)
    try:
        wait_for_training(out, first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert (out / NAME).is_file()  # a killed run cannot release it
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "2", "--eval-every", "0",
                    "--output-dir", out, "--resume", "auto")  # fmt: skip
    assert code == 0, err
    taken = f"took over the lock left by process {first.pid} on {socket.gethostname()}"
    assert taken in (out / "log-rank0.txt").read_text() and "which is gone" in err
    assert not (out / NAME).exists()


def test_a_lock_held_from_another_host_is_taken_only_with_break_lock(run, tiny_data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    elsewhere = {"host": "another-node", "pid": 4242, "pid_started": 1, "since": "2026-12-01 "
                 "10:00:00", "command": "python -m fasttrain ..."}  # fmt: skip
    (out / NAME).write_text(json.dumps(elsewhere))
    common = ["--data", tiny_data, *FAST, "--max-steps", "1", "--eval-every", "0",
              "--output-dir", out]  # fmt: skip
    code, err = run(*common)
    assert code == 2, err
    line = one_line_error(err)
    assert "another run holds it (process 4242 on another-node, since 2026-12-01" in line
    assert "which this host cannot check" in line and "add --break-lock" in line
    assert json.loads((out / NAME).read_text()) == elsewhere  # left as it was
    assert not (out / "config.yaml").exists()  # nothing written
    code, err = run(*common, "--break-lock")
    assert code == 0, err
    assert (
        "--break-lock took the lock held by process 4242 on another-node"
        in (out / "log-rank0.txt").read_text()
    )


def test_the_lock_is_released_at_the_end_and_when_a_start_fails(run, tiny_data, tmp_path):
    out = tmp_path / "ok"
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "1", "--eval-every", "0",
                    "--output-dir", out)  # fmt: skip
    assert code == 0 and not (out / NAME).exists()
    used = tmp_path / "used"
    used.mkdir()  # a folder of the user's, kept when the start fails
    code, err = run("--data", tiny_data, *FAST, "--num-classes", "2", "--output-dir", used)
    assert code == 2 and "--num-classes 2" in err
    assert not (used / NAME).exists()
    # evaluate holds its folder too, and gives it back
    weights = sorted(out.glob("ckpt-*.pt"))[-1]
    code, err = run("evaluate", weights, "--data", tiny_data, *FAST, "--output-dir", out / "e")
    assert code == 0 and not (out / "e" / NAME).exists()


def test_a_reused_process_id_is_not_taken_for_the_holder(tmp_path):
    """The holder is this process's id with another start time: the process that held the lock
    is gone (its id was reused), and the lock is taken over."""
    me = Holder.me()
    assert me.gone() is False and me.pid_started == process_started(os.getpid())
    reused = Holder(me.host, me.pid, (me.pid_started or 0) + 1, me.since, me.command)
    assert reused.gone() is True
    (tmp_path / NAME).write_text(json.dumps(reused.__dict__))
    lock = RunLock(tmp_path)
    note = lock.acquire()
    assert note is not None and "which is gone" in note and lock.held
    assert json.loads((tmp_path / NAME).read_text())["pid_started"] == me.pid_started
    lock.release()
    assert not (tmp_path / NAME).exists()
