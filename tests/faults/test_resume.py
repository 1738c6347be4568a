"""Resuming and run folders: a checkpoint that cannot resume is one line, a finished run is left
as it is, --resume auto finds the right run, and a run branching from an older step keeps its
own checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import FAST
from tests.faults.conftest import copy_data, one_line_error


def test_resume_missing_or_corrupt(run, tiny_data, tmp_path):
    missing = tmp_path / "missing.pt"
    code, err = run("--data", tiny_data, *FAST, "--output-dir", tmp_path / "o", "--resume", missing)
    assert code == 2 and f"--resume {missing}: no such checkpoint file" in one_line_error(err)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"PK\x03\x04 definitely not a whole zip")
    code, err = run("--data", tiny_data, *FAST, "--output-dir", tmp_path / "o", "--resume", corrupt)
    assert code == 2 and f"--resume {corrupt}: the checkpoint is corrupt" in one_line_error(err)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    code, err = run("--data", tiny_data, *FAST, "--output-dir", tmp_path / "o", "--resume", foreign)
    assert code == 2 and "not a fasttrain checkpoint" in one_line_error(err)


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
    line = one_line_error(err)
    assert line.startswith(
        f"fasttrain: error: --resume {ckpt_path}: its model (resnet18, 4 classes) does not fit "
        "this run's (resnet34, 4 classes): "
    )
    assert line.endswith(
        "resume with the checkpoint's --arch and --num-classes, or start without --resume"
    )


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

    summary = json.loads((first / "summary.json").read_text())
    assert (summary["start_step"], summary["steps"]) == (2, 4)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([first.name, "other"])


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


def test_a_start_that_fails_leaves_no_run_folder(run, tiny_data, tmp_path, monkeypatch):
    """A run folder is created for the run, and removed again if the run cannot start; a folder
    the user named and that existed before stays."""

    monkeypatch.chdir(tmp_path)
    data = copy_data(tiny_data, tmp_path)
    shutil.rmtree(data / "val")
    code, err = run("--data", data, *FAST)
    assert code == 2 and "no val/ folder" in one_line_error(err)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    code, err = run("--data", data, *FAST, "--output-dir", mine)
    assert code == 2 and mine.is_dir()
