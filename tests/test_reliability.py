"""Faults a long run meets, injected for real: preemption signals (in a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, last_checkpoint, train_loader

pytestmark = pytest.mark.slow


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


def nan_once(call: int):
    """CrossEntropyLoss.forward, returning NaN on one call (one step: no accumulation)."""
    forward = torch.nn.CrossEntropyLoss.forward
    calls = [0]

    def patched(self, logits, labels):
        loss = forward(self, logits, labels)
        calls[0] += 1
        return loss * float("nan") if calls[0] == call else loss

    return patched


def nan_run(run, tiny_data, out, policy, monkeypatch):
    monkeypatch.setattr(torch.nn.CrossEntropyLoss, "forward", nan_once(call=6))  # step 6
    return run(
        "--data",
        tiny_data,
        *FAST,
        "--max-steps",
        "10",
        "--eval-every",
        "0",
        "--log-every",
        "2",
        "--ckpt-every-steps",
        "4",
        "--on-nan",
        policy,
        "--output-dir",
        out,
    )


def test_nonfinite_loss_stops_with_a_diagnostic_and_no_bad_checkpoint(
    run, tiny_data, tmp_path, monkeypatch
):
    out = tmp_path / "nan-stop"
    code, err = nan_run(run, tiny_data, out, "stop", monkeypatch)
    assert code == 3
    line = [x for x in err.splitlines() if x.startswith("fasttrain: error:")]
    assert len(line) == 1 and "NaN or infinite between steps 4 and 6" in line[0]
    diagnostic = json.loads((out / "nonfinite.json").read_text())
    assert diagnostic["between_steps"] == [4, 6] and diagnostic["last_finite_loss_step"] == 4
    assert diagnostic["last_finite_loss"] > 0
    assert last_checkpoint(out)["step"] == 4  # the NaN weights were never saved


def test_nonfinite_loss_skip_restores_the_checkpoint_and_trains_on(
    run, tiny_data, tmp_path, monkeypatch
):
    out = tmp_path / "nan-skip"
    code, err = nan_run(run, tiny_data, out, "skip", monkeypatch)
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert "NaN or infinite between steps 4 and 6" in log and "(step 4)" in log
    assert "restored the weights and optimizer of" in log
    final = last_checkpoint(out)
    assert final["step"] == 10
    assert all(torch.isfinite(v).all() for v in final["model"].values() if v.is_floating_point())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    bad = [r["step"] for r in records if r.get("nonfinite_losses")]
    assert bad == [6]  # once, and the steps after it are finite again


def poison_after(call: int, name: str):
    """torch's SGD step, which on its ``call``-th call leaves ``name``'s tensor infinite after the
    update: the weights break while the loss of that step, computed before, is still finite."""
    step = torch.optim.SGD.step
    calls = [0]

    def patched(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == call:
            target = POISON_TARGETS[name]
            with torch.no_grad():
                target[(0,) * target.dim()] = float("inf")
        return out

    return patched


POISON_TARGETS: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_checkpoint_is_never_written_with_nonfinite_weights(
    run, tiny_data, tmp_path, monkeypatch, policy
):
    """Weights that break in the step right before a checkpoint are never saved: stop exits 3
    naming the tensor; skip restores the newest finite checkpoint and trains on."""
    import fasttrain.run.build as builder

    build = builder.build_training

    def remember(*args, **kwargs):
        training = build(*args, **kwargs)
        POISON_TARGETS["layer1.0.conv1.weight"] = training.model.layer1[0].conv1.weight
        return training

    monkeypatch.setattr(builder, "build_training", remember)
    monkeypatch.setattr(torch.optim.SGD, "step", poison_after(8, "layer1.0.conv1.weight"))
    out = tmp_path / policy
    code, err = run(
        "--data", tiny_data, *FAST, "--max-steps", "10", "--eval-every", "0", "--log-every",
        "5", "--ckpt-every-steps", "4", "--on-nan", policy, "--output-dir", out,
    )  # fmt: skip
    steps = sorted(torch.load(p, weights_only=True)["step"] for p in out.glob("ckpt-*.pt"))
    for p in out.glob("ckpt-*.pt"):
        state = torch.load(p, weights_only=True)
        assert all(
            torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()
        )
    if policy == "stop":
        assert code == 3, err
        assert "layer1.0.conv1.weight holds NaN or infinite values at step 8" in err
        assert json.loads((out / "nonfinite.json").read_text())["first_nonfinite_tensor"] == (
            "layer1.0.conv1.weight"
        )
        assert steps == [4]
    else:
        assert code == 0, err
        assert "restored the weights and optimizer of" in (out / "log-rank0.txt").read_text()
        assert 8 not in steps and steps[-1] == 10


def odd_images(root: Path) -> dict[str, str]:
    """Every kind of file a real photo folder holds, one per name: what each should become."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)

    def rgb(w=96, h=80):
        return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))

    for d in ("train/a", "train/b", "val/a", "val/b"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for c in "ab":
        for i in range(4):
            rgb().save(root / f"train/{c}/ok{i}.jpg")
        rgb().save(root / f"val/{c}/v.jpg")
    rgb().convert("L").save(root / "train/a/gray.jpg")
    rgb().convert("CMYK").save(root / "train/a/cmyk.jpg")
    sixteen = (rng.integers(0, 256, (80, 96)) * 257).astype(np.uint16)  # mid-grey on average
    Image.fromarray(sixteen).save(root / "train/b/sixteen.png")
    rgb().save(root / "train/b/png_named.jpg", format="PNG")
    Image.new("RGB", (10000, 10000), (90, 120, 200)).save(root / "train/b/huge.jpg", quality=50)
    tga = io.BytesIO()
    rgb().save(tga, format="TGA")
    (root / "train/a/tga_named.jpg").write_bytes(tga.getvalue())  # PIL reads it, DALI does not
    (root / "train/a/text.jpg").write_text("not an image at all\n")
    (root / "train/b/zero.jpg").write_bytes(b"")
    buf = io.BytesIO()
    rgb().save(buf, format="JPEG")
    (root / "train/a/truncated.jpg").write_bytes(buf.getvalue()[:200])
    return {
        "gray.jpg": "converted",
        "cmyk.jpg": "converted",
        "sixteen.png": "converted",
        "png_named.jpg": "converted",
        "huge.jpg": "converted",
        "tga_named.jpg": "converted",
        "text.jpg": "skipped",
        "zero.jpg": "skipped",
        "truncated.jpg": "skipped",
    }


@pytest.fixture(scope="module")
def odd_data(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("odd")
    return root, odd_images(root)


def test_torchvision_loader_converts_odd_images_and_skips_broken_ones(odd_data):
    from fasttrain.data.folder import scan_folder
    from fasttrain.data.torchvision import ImageFolderDataset

    root, expect = odd_data
    samples = scan_folder(root).train
    ds = ImageFolderDataset(samples, train=False, image_size=32, seed=0)
    for index, (path, label) in enumerate(samples):
        name = Path(path).name
        x, got_label, bad = ds[(index, 0)]
        assert x.shape == (32, 32, 3), name
        if expect.get(name) == "skipped":  # val-style: counted, label -1, never another's label
            assert got_label == -1 and bad == path, name
        else:
            assert got_label == label and bad == "", name
        if name == "sixteen.png":  # scaled to 8 bits, not clipped to white
            assert 60 < x.float().mean() < 200
    loader = train_loader(samples, batch_size=4)
    loader.set_epoch(0)
    batches = list(loader)
    assert len(batches) == len(samples) // 4
    skipped = {Path(p).name for p in loader.bad_files}
    assert skipped == {n for n, what in expect.items() if what == "skipped"}


def test_dali_decodes_every_odd_image_once_check_data_listed_the_broken(odd_data, tmp_path):
    pytest.importorskip("nvidia.dali")
    from fasttrain.data.check import find_bad_files, find_dali_rejects
    from fasttrain.data.dali import DaliLoader
    from fasttrain.data.folder import scan_folder

    root, expect = odd_data
    _, bad = find_bad_files(root, workers=2)
    assert {Path(p).name for p, _ in bad} == {n for n, w in expect.items() if w == "skipped"}
    # the second pass: what PIL read, through DALI's own decoder (as check-data runs it)
    rejected = {p for p, _ in bad}
    scanned = scan_folder(root)
    good = [p for p, _ in scanned.train + scanned.val if p not in rejected]
    dali_bad = find_dali_rejects(good, threads=2)
    assert [Path(p).name for p, _ in dali_bad] == ["tga_named.jpg"]
    assert "DALI's decoder rejects it" in dali_bad[0][1]
    samples = scan_folder(root, rejected | {p for p, _ in dali_bad}).train
    indexed = [(path, i) for i, (path, _) in enumerate(samples)]
    loader = DaliLoader(
        indexed,
        train=False,
        image_size=32,
        batch_size=4,
        threads=2,
        hw_decoder_load=0.99,
        seed=0,
        rank=0,
        world=1,
        local_rank=0,
        device=torch.device("cpu"),
        channels_last=True,
    )
    loader.set_epoch(0)
    seen = torch.cat([y.clone() for _, y in loader])
    assert sorted(seen[seen >= 0].tolist()) == list(range(len(samples)))  # each decoded once


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
