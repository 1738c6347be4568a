"""The disk: an unwritable or full output folder is found before training, and a checkpoint
write that fails mid-run is loud and keeps the previous checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import FAST, last_checkpoint
from tests.faults.conftest import one_line_error


def test_unwritable_output_dir(run, tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory should go")
    code, err = run("--data", tiny_data, *FAST, "--output-dir", blocker / "run")
    assert code == 2 and f"--output-dir {blocker / 'run'}: cannot write there" in one_line_error(
        err
    )


@pytest.mark.parametrize("free_mib", [1, 150])
def test_a_full_output_disk_is_found_before_training(
    run, tiny_data, tmp_path, monkeypatch, free_mib
):
    """resnet18's checkpoint is about 85 MiB: with 1 MiB free the run stops before its first
    step with one line; with 150 MiB it would hold fewer than --keep-checkpoints 3 of them, so it
    trains and warns (the save itself then fails loudly, the test above)."""
    from fasttrain.run import checkpoint as ckpt

    real = shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: real(p)._replace(free=free_mib << 20))
    monkeypatch.setattr(torch, "save", lambda *a, **k: None)  # nothing reaches the real disk
    out = tmp_path / "out"
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "1", "--output-dir", out)
    if free_mib == 1:
        line = one_line_error(err)
        assert code == 2 and f"--output-dir {out}: 1 MiB free" in line
        assert "a checkpoint takes about" in line and not (out / "metrics.jsonl").exists()
    else:
        assert code == 0, err
        log = (out / "log-rank0.txt").read_text()
        warned = [ln for ln in log.splitlines() if "MiB free holds fewer" in ln]
        assert len(warned) == 1 and "WARNING" in warned[0] and "--keep-checkpoints 3" in warned[0]


# how a full disk reaches fasttrain: as the OS's error, or through torch.save's zip writer
FULL_DISK = {
    "oserror": (OSError, (28, "No space left on device"), "No space left"),
    "zip writer": (
        RuntimeError,
        (
            "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
            "data/12: file write failed",
        ),
        "PytorchStreamWriter failed writing file data/12: file write failed",
    ),
}


@pytest.mark.parametrize("how", list(FULL_DISK))
def test_a_failed_checkpoint_write_is_loud_and_keeps_the_previous(
    run, tiny_data, tmp_path, monkeypatch, how
):
    """The disk fills at the second checkpoint: one line naming it, exit 1, the first intact."""
    error, args, reason = FULL_DISK[how]
    real = torch.save
    calls = [0]

    def full_disk(obj, f, *a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise error(*args)
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "full"
    code, err = run(
        "--data",
        tiny_data,
        *FAST,
        "--max-steps",
        "6",
        "--eval-every",
        "0",
        "--ckpt-every-steps",
        "2",
        "--output-dir",
        out,
    )
    assert code == 1
    line = one_line_error(err)
    assert "could not write the checkpoint of step 4" in line and reason in line
    assert "ckpt-00000002.pt is intact" in line
    saved = last_checkpoint(out)
    assert saved["step"] == 2
    # the free-space check's estimate against this real checkpoint (resnet18 and its momentum)
    from fasttrain.model.build import build_model
    from fasttrain.run import checkpoint as ckpt

    heads = saved["model"]["fc.bias"].numel()
    estimate = ckpt.checkpoint_bytes(build_model("resnet18", heads, True, torch.device("cpu")))
    assert 0.9 < estimate / (out / "ckpt-00000002.pt").stat().st_size < 1.1
    assert not list(out.glob(".ckpt-*"))  # no half-written temporary left behind
