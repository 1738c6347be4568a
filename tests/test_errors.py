"""Every bad input of the foundation issue: one line naming the file or flag, exit code 2."""

import shutil
import subprocess
import sys

import pytest
import torch

from fasttrain.__main__ import main
from fasttrain.step.step import EagerStep
from tests.conftest import FAST, last_checkpoint, make_tree


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("fasttrain: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "files, flag_text",
    [
        (None, "--data {d}: no such directory"),
        ([], "--data {d}: the directory is empty"),
        (["val/a/x.jpg"], "--data {d}: no train/ folder"),
        (["train/a/x.jpg"], "--data {d}: no val/ folder"),
        (
            ["train/a/x.jpg", "train/b/notes.txt", "val/a/x.jpg"],
            "class folder {d}/train/b holds no",
        ),
        (["train/a/x.jpg", "val/c/y.jpg"], "class folders not in train/: c"),
    ],
)
def test_bad_data_folders(run, tmp_path, files, flag_text):
    d = tmp_path / "data"
    if files is not None:
        d.mkdir()
        make_tree(d, files)
    code, err = run("--data", d, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert flag_text.format(d=d) in one_line_error(err)


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


def test_batch_larger_than_the_dataset(run, tiny_data, tmp_path):
    code, err = run(
        "--data",
        tiny_data,
        *FAST[:-6],
        "--batch-size",
        "1000",
        "--device",
        "cpu",
        "--output-dir",
        tmp_path / "o",
    )
    assert code == 2 and "--batch-size 1000" in one_line_error(err)


def test_unknown_flag_and_bad_choice_exit_2(run, tiny_data):
    for argv in (["--bogus"], ["--arch", "vgg16"], ["--amp", "fp8"]):
        with pytest.raises(SystemExit) as e:
            run("--data", tiny_data, *argv)
        assert e.value.code == 2


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


def test_unwritable_output_dir(run, tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory should go")
    code, err = run("--data", tiny_data, *FAST, "--output-dir", blocker / "run")
    assert code == 2 and f"--output-dir {blocker / 'run'}: cannot write there" in one_line_error(
        err
    )


def test_world_size_without_a_rendezvous_says_how_to_launch(run, tiny_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    code, err = run("--data", tiny_data, *FAST)
    line = one_line_error(err)
    assert code == 2 and "WORLD_SIZE=2 without MASTER_ADDR" in line and "--nproc-per-node" in line


def test_bad_nproc_per_node_is_one_line(run):
    code, err = run("--nproc-per-node", "zero", "--device", "cpu")
    assert code == 2 and "--nproc-per-node 'zero'" in one_line_error(err)


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


def test_corrupt_images_do_not_stop_a_run(run, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    bad = [
        next((data / "train" / "class_001").iterdir()),
        next((data / "val" / "class_002").iterdir()),
    ]
    bad[0].write_bytes(b"\xff\xd8\xff\xe0 truncated")
    bad[1].write_bytes(b"")
    out = tmp_path / "out"
    code, err = run("--data", data, *FAST, "--epochs", "1", "--output-dir", out)
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert str(bad[0]) in log and str(bad[1]) in log and "undecodable" in log
    assert run.records(out, "val")[-1]["images"] == 99  # one val image skipped, none counted twice


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


def test_env_report(capsys, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    code = main(["env"])
    out = capsys.readouterr().out
    assert code == 0
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in out  # main claimed the hardware queues
    for field in ("torch", "CUDA", "cuDNN", "NCCL", "triton", "DALI", "GPUs"):
        assert field in out
    assert torch.__version__ in out


def test_env_warns_when_dali_is_built_for_another_cuda(capsys, monkeypatch):
    import fasttrain.data.dali_install as dali

    monkeypatch.setattr(dali, "installed_dali_builds", lambda: {"nvidia-dali-cuda120": "2.4.0"})
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "  warning: DALI (nvidia-dali-cuda120) is built for another CUDA major version" in out


def test_a_users_hardware_queue_setting_is_kept(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert main(["env"]) == 0
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in capsys.readouterr().out


def test_python_warnings_go_into_the_log_and_above_the_progress_bar(tmp_path, capsys):
    """A torch warning printed onto the bar's line broke it: warnings take the log's handlers
    (the rank's file, and tqdm.write on the console)."""
    import logging
    import warnings

    from fasttrain.dist.state import DistState
    from fasttrain.run.runtime import setup_logging

    setup_logging(tmp_path, DistState(0, 0, 1, torch.device("cpu")))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a warning raised mid-run", UserWarning, stacklevel=1)
    for h in logging.getLogger("fasttrain").handlers:
        h.flush()
    assert "UserWarning: a warning raised mid-run" in (tmp_path / "log-rank0.txt").read_text()
    assert "a warning raised mid-run" in capsys.readouterr().err
