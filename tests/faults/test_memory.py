"""GPU memory running out: one line naming the batch and what to do, and the last completed step
checkpointed."""

from __future__ import annotations

import pytest
import torch

from fasttrain.step.step import EagerStep
from tests.conftest import FAST, last_checkpoint
from tests.faults.conftest import one_line_error


@pytest.mark.parametrize(
    "extra, names",
    [
        ([], "--batch-size 16"),
        (["--progressive-resizing", "32:64:1:2", "--batch-sizes", "32:8"], "--batch-sizes 32:8"),
    ],
)
def test_out_of_memory_names_the_batch_and_what_to_do(
    run, tiny_data, tmp_path, monkeypatch, extra, names
):
    """The batch the failing step ran at: --batch-size's, or its train size's own."""

    def oom(self, batches, meter, step):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(EagerStep, "__call__", oom)
    code, err = run("--data", tiny_data, *FAST, *extra, "--output-dir", tmp_path / "o")
    assert code == 1
    line = one_line_error(err)
    assert f"out of GPU memory at {names}" in line and "--accum-steps" in line


def test_out_of_memory_mid_run_checkpoints_the_last_completed_step(
    run, tiny_data, tmp_path, monkeypatch
):
    real = EagerStep.__call__
    calls = [0]

    def oom_at_step_6(self, batches, meter, step):
        calls[0] += 1
        if calls[0] == 6:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, batches, meter, step)

    monkeypatch.setattr(EagerStep, "__call__", oom_at_step_6)
    out = tmp_path / "o"
    flags = ["--data", tiny_data, *FAST, "--max-steps", "8", "--eval-every", "0"]
    code, err = run(*flags, "--output-dir", out)
    assert code == 1
    assert "saved a checkpoint of step 5: --resume auto continues" in one_line_error(err)
    assert last_checkpoint(out)["step"] == 5
    monkeypatch.setattr(EagerStep, "__call__", real)
    code, err = run(*flags, "--output-dir", out, "--resume", "auto")
    assert code == 0, err
    assert last_checkpoint(out)["step"] == 8
