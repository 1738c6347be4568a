"""Each rank sees its own GPU only, as cuda:0 (``dist/devices.py``), for every launcher: the
environment alone decides it, so it is tested on the CPU."""

from __future__ import annotations

import pytest

from fasttrain.dist.devices import one_gpu_per_rank


@pytest.mark.parametrize(
    ("env", "kept"),
    [
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "1"}, "1"),  # torchrun, no list
        ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "6"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, "GPU-b"),
        # an srun task: SLURM's variables, its step's GPUs
        (
            {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
             "SLURM_NTASKS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1"},
            "1",
        ),  # fmt: skip
    ],
)
def test_a_rank_among_several_keeps_its_own_gpu(env, kept):
    assert one_gpu_per_rank(env) == kept and env["CUDA_VISIBLE_DEVICES"] == kept


@pytest.mark.parametrize(
    "env",
    [
        {},  # one process, no launcher
        {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": "0,1"},  # alone
        {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3"},  # srun's one
        {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "0,1"},  # too few
        {"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"},  # DistState names the bad value
    ],
)
def test_otherwise_nothing_changes(env):
    before = dict(env)
    assert one_gpu_per_rank(env) is None and env == before
