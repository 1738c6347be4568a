"""An srun launch: SLURM's variables mapped to torchrun's, and a two-task run through them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from fasttrain.dist.slurm import scontrol_hostnames, torchrun_env
from fasttrain.errors import UserError
from tests.conftest import FAST, last_checkpoint

TASK = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
}


def test_an_srun_task_gets_torchruns_variables():
    seen = []

    def hostnames(nodelist):
        seen.append(nodelist)
        return ["gpu07", "gpu08"]

    assert torchrun_env(TASK, hostnames) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",  # the first node hosts the rendezvous
        "MASTER_PORT": str(15000 + 123456 % 20000),
    }
    assert seen == ["gpu[07-08]"]
    given = torchrun_env({**TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, hostnames)
    assert "MASTER_ADDR" not in given and "MASTER_PORT" not in given  # the user's win


def test_only_srun_tasks_without_torchrun_are_mapped():
    assert torchrun_env({**TASK, "RANK": "0", "WORLD_SIZE": "2"}) == {}  # srun ... torchrun
    shell = {k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}  # an salloc shell
    assert torchrun_env(shell) == {}
    assert torchrun_env({}) == {}
    one = torchrun_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEPID": "0"})
    assert one["WORLD_SIZE"] == "1" and "MASTER_ADDR" not in one


def test_node_lists_expand_through_scontrol(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && '
                    'printf "gpu07\\ngpu08\\n"\n')  # fmt: skip
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert scontrol_hostnames("gpu[07-08]") == ["gpu07", "gpu08"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert scontrol_hostnames("a1,a2") == ["a1", "a2"]  # plain names need no scontrol
    with pytest.raises(UserError, match=r"scontrol is not on PATH .* set MASTER_ADDR"):
        scontrol_hostnames("gpu[07-08]")


@pytest.mark.dist
@pytest.mark.slow
def test_two_srun_tasks_train_as_ddp_without_torchrun(tiny_data, tmp_path):
    """Two processes started as srun starts them (SLURM variables only, scontrol faked): they
    find each other, train with DDP, and write one checkpoint."""
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho localhost\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "run"
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base["PATH"] = f"{fake.parent}{os.pathsep}{base['PATH']}"
    procs = []
    for rank in range(2):
        env = dict(base, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2",
                   SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="node[1]",
                   SLURM_JOB_ID=str(os.getpid()), SLURM_STEP_ID="0")  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "fasttrain", "--data", str(tiny_data), *FAST, "--batch-size",
             "8", "--max-steps", "3", "--eval-every", "0", "--output-dir", str(out)],
            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    log0 = (out / "log-rank0.txt").read_text()
    assert "global batch 16 (8 per process x 2 processes x 1 accum)" in log0
    assert (out / "log-rank1.txt").is_file()
    state = last_checkpoint(out)
    assert state["step"] == 3 and state["world_size"] == 2
