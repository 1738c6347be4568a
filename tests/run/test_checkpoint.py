"""Atomic writes, validation and choosing the newest valid checkpoint."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fasttrain.errors import UserError
from fasttrain.run import checkpoint as ckpt
from fasttrain.run import resume


def state(step: int, size: int = 10) -> dict:
    return {
        "model": {"w": torch.full((size,), float(step))},
        "optimizer": {},
        "step": step,
        "epoch": 0,
        "loader": {"epoch": 0, "start_batch": step},
        "config": {},
    }


def test_keeps_the_newest_k(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(state(step), tmp_path, step, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "ckpt-00000004.pt",
        "ckpt-00000003.pt",
    ]
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_latest_valid_skips_a_corrupt_newest(tmp_path, caplog):
    ckpt.save_checkpoint(state(1), tmp_path, 1, keep=5)
    path2 = ckpt.save_checkpoint(state(2), tmp_path, 2, keep=5)
    path2.write_bytes(path2.read_bytes()[:100])  # truncated, e.g. by a full disk
    path, loaded = ckpt.latest_valid(tmp_path)
    assert path.name == "ckpt-00000001.pt" and loaded["step"] == 1
    assert "skipping" in caplog.text and "corrupt" in caplog.text


def test_an_exception_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt.save_checkpoint(state(1), tmp_path, 1, keep=5)

    def fail(obj, f):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(state(2), tmp_path, 2, keep=5)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000001.pt"]  # tmp file cleaned up
    assert ckpt.latest_valid(tmp_path)[1]["step"] == 1


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    ckpt.save_checkpoint(state(1), tmp_path, 1, keep=5)
    # a real writer process, killed with SIGKILL while its (large) checkpoint is part-way written
    code = textwrap.dedent(f"""
        import torch
        from fasttrain.run import checkpoint as ckpt
        big = {{"model": {{"w": torch.ones(200_000_000)}}, "optimizer": {{}}, "step": 2,
                "epoch": 0, "loader": {{}}, "config": {{}}}}
        ckpt.save_checkpoint(big, {str(tmp_path)!r}, 2, keep=5)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 120
    partial = None
    while time.time() < deadline and proc.poll() is None:
        tmps = [p for p in tmp_path.iterdir() if ".tmp" in p.name]
        if tmps and tmps[0].stat().st_size > 1_000_000:
            partial = tmps[0]
            break
        time.sleep(0.005)
    assert partial is not None, "the writer finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert partial.stat().st_size < 800_000_000  # it really was part-way
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-00000001.pt"]
    _, loaded = ckpt.latest_valid(tmp_path)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["w"], torch.ones(10))


def test_load_checkpoint_names_the_file(tmp_path):
    with pytest.raises(UserError, match="no such checkpoint file"):
        ckpt.load_checkpoint(tmp_path / "x.pt")


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = resume.rng_state()
    torch.save(saved, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))
    resume.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
