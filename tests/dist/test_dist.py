"""Two processes on the CPU with gloo: DDP's step against one process on the same global batch,
and the trainer launched by ``python -m fasttrain --nproc-per-node 2``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from fasttrain.config import OptimConfig, TrainConfig
from fasttrain.data.torchvision import TrainSampler
from fasttrain.dist.parallel import wrap_model
from fasttrain.dist.state import CollectiveTimeout, DistState
from fasttrain.metrics.meter import DeviceMeter
from fasttrain.step.optim import build_optimizer
from fasttrain.step.step import build_step
from tests.conftest import FAST, constant_lr, last_checkpoint

pytestmark = pytest.mark.dist
GLOBAL_BATCH, STEPS = 16, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_net() -> nn.Module:
    """GroupNorm, not BatchNorm: each rank's normalisation must not depend on its share of the
    batch, so DDP's averaged gradient equals the full batch's exactly."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def join(rank: int, world: int, port: int, timeout_s: int) -> DistState:
    """This process as ``rank`` of ``world`` on the CPU (gloo), from the environment torchrun
    would set."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return DistState.from_env("cpu", timeout_s=timeout_s)


def sgd_step(model: nn.Module, net: nn.Module):
    """An eager fp32 step of ``net`` (``model``, wrapped) with SGD at a constant LR of 0.1."""
    return build_step(
        model=net,
        optimizer=build_optimizer(model, OptimConfig(), 0.1),
        criterion=nn.CrossEntropyLoss(),
        amp_dtype=None,
        scaler=None,
        schedule=constant_lr(0.1),
        compile=False,
    )


def _worker(rank: int, world: int, port: int, out: str, hook: str = "none") -> None:
    dist = join(rank, world, port, timeout_s=120)
    torch.manual_seed(0)
    model = tiny_net()
    t = TrainConfig(strategy="ddp" if world > 1 else "none", ddp_comm_hook=hook)
    net = wrap_model(model, t, dist).net
    step = sgd_step(model, net)
    meter = DeviceMeter(torch.device("cpu"), dist)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g)
        y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
        step([(x[rank::world], y[rank::world])], meter, i)  # this rank's share
        losses.append(meter.flush()[0])  # the mean over every rank's samples
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every_rank = dist.all_gather_object(flat)
    # the trainer's own sampler on this rank, as build_data makes it: which images it would read
    sampler = TrainSampler(100, rank, world, seed=0, batch_at=lambda epoch: 8)
    sampler.set_position(epoch=1, start_batch=0)
    seen = dist.all_gather_object([i for batch in sampler for i, _ in batch])
    if rank == 0:
        torch.save({"losses": losses, "params": every_rank, "seen": seen}, out)
    # DDP (and a comm hook's futures) must go before the process group, as the trainer's has
    # by the time it closes: DistState.close frees what is left unreachable
    del step, net
    dist.close()


def spawn(world: int, tmp_path: Path, hook: str = "none") -> dict:
    out = tmp_path / f"world{world}-{hook}.pt"
    mp.spawn(_worker, args=(world, free_port(), str(out), hook), nprocs=world, join=True)
    return torch.load(out)


def test_ddp_step_matches_one_process_on_the_same_global_batch(tmp_path):
    one, two = spawn(1, tmp_path), spawn(2, tmp_path)
    a, b = two["params"]
    assert torch.equal(a, b)  # the ranks hold the same parameters after every step
    torch.testing.assert_close(a, one["params"][0], rtol=1e-5, atol=1e-6)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    seen = [set(indices) for indices in two["seen"]]
    assert not seen[0] & seen[1]  # the ranks read disjoint images
    assert len(seen[0]) == len(seen[1]) == 48  # 100 // 2 per rank, in whole batches of 8
    assert seen[0] | seen[1] < set(range(100))


def test_bf16_comm_hook_reduces_in_bf16_and_keeps_the_ranks_equal(tmp_path):
    """--ddp-comm-hook bf16: the all-reduce runs on bf16 copies of the gradients, so the result
    is near the exact one but not equal to it, and every rank applies the same update."""
    one, exact, bf16 = spawn(1, tmp_path), spawn(2, tmp_path), spawn(2, tmp_path, "bf16")
    a, b = bf16["params"]
    assert torch.equal(a, b)
    assert not torch.equal(a, exact["params"][0])  # the hook ran: bf16 rounding shows
    torch.testing.assert_close(a, one["params"][0], rtol=2e-2, atol=2e-3)
    assert bf16["losses"] == pytest.approx(one["losses"], rel=1e-2)


def _hung_rank_worker(rank: int, port: int, out: str) -> None:
    dist = join(rank, 2, port, timeout_s=3)
    if rank == 1:  # hangs: never joins the log step's all-reduce
        time.sleep(12)
        os._exit(0)
    meter = DeviceMeter(torch.device("cpu"), dist)
    try:
        meter.flush()
        Path(out).write_text("no error")
    except CollectiveTimeout as e:
        Path(out).write_text(f"{e.exit_code} {e}")
    # leave without tearing down a process group whose collective timed out: gloo's threads
    # abort the interpreter's exit now and then ("terminate called without an active
    # exception"), which is not what this test is about (the trainer's own exit is bounded by
    # its watchdog)
    os._exit(0)


def test_a_hung_rank_is_an_error_naming_the_rank_and_the_collective(tmp_path):
    out = tmp_path / "error.txt"
    t = time.perf_counter()
    mp.spawn(_hung_rank_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    text = out.read_text()
    assert text.startswith("1 rank 0: the all_reduce of the metrics at a log step waited longer")
    assert "--dist-timeout" in text and "log-rank<N>.txt" in text
    assert time.perf_counter() - t < 60


def _stop_worker(rank: int, port: int, out: str) -> None:
    dist = join(rank, 2, port, timeout_s=60)
    meter = DeviceMeter(torch.device("cpu"), dist)
    meter.add_device(torch.tensor(float(rank + 1)), torch.tensor(float(rank)), 4)
    meter.samples += 4
    meter.add_update(torch.tensor([65536.0]), torch.tensor([32768.0]))  # fp16: one skipped
    reading = meter.collect(stop=rank == 1)  # only rank 1 was asked to stop
    Path(out).with_suffix(f".{rank}").write_text(json.dumps([*reading.values(), reading.samples]))
    dist.close()  # left to interpreter exit, gloo's threads can abort the process


def test_a_stop_request_on_one_rank_reaches_every_rank_with_the_metrics(tmp_path):
    """One all-reduce at a log step carries the metrics and the ranks' stop requests: every
    rank reads the same totals, and that one rank asked to stop."""
    out = tmp_path / "reading"
    mp.spawn(_stop_worker, args=(free_port(), str(out)), nprocs=2, join=True)
    got = [json.loads(out.with_suffix(f".{rank}").read_text()) for rank in (0, 1)]
    # loss sums 4 x 1 + 4 x 2 over 8 samples; 1 correct of 8; no non-finite loss; one stop;
    # the update both ranks skipped counted once, and their common loss scale
    assert got[0] == got[1] == [1.5, 12.5, 0, 1, 1, 32768.0, 8]


def launch(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fasttrain", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.mark.slow
def test_two_process_run_checkpoints_once_and_resumes_on_one(tiny_data, tmp_path):
    """``--nproc-per-node 2`` trains with DDP over gloo: one log per rank, one checkpoint
    writer, and its checkpoint resumes in a single process (another world size)."""
    out = tmp_path / "two"
    common = ["--data", tiny_data, *FAST, "--device", "cpu", "--batch-size", "8"]
    r = launch("--nproc-per-node", "2", *common, "--max-steps", "9", "--output-dir", out)
    assert r.returncode == 0, r.stderr[-3000:]
    log0 = (out / "log-rank0.txt").read_text()
    assert (out / "log-rank1.txt").is_file()
    batch = "global batch 16 (8 per process x 2 processes x 1 accum)"
    assert f"strategy ddp (100 MB buckets) | {batch}" in log0
    state = last_checkpoint(out)
    assert state["step"] == 9 and state["world_size"] == 2 and state["global_batch"] == 16
    assert [p.name for p in out.glob("ckpt-*.pt")] == ["ckpt-00000009.pt"]  # written once
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(rec["kind"] in ("train", "val") for rec in train)  # one writer: no torn lines
    val = [rec for rec in train if rec["kind"] == "val"]
    assert val and val[-1]["images"] == 100  # each rank evaluated half, counted once

    # the same checkpoint, one process at batch 16: the same global batch, step 9 carries on
    one = tmp_path / "one"
    one.mkdir()
    r = launch(
        *common,
        "--batch-size",
        "16",
        "--max-steps",
        "12",
        "--output-dir",
        one,
        "--resume",
        out / "ckpt-00000009.pt",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        last_checkpoint(one)["step"] == 12 and "resumed from" in (one / "log-rank0.txt").read_text()
    )

    # one process at batch 8 (global batch 8, 24 steps per epoch): 9 steps of 16 images are
    # 18 steps of 8
    half = tmp_path / "half"
    r = launch(
        *common, "--max-steps", "20", "--output-dir", half, "--resume", out / "ckpt-00000009.pt"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = (half / "log-rank0.txt").read_text()
    assert "step 9 becomes step 18" in text and last_checkpoint(half)["step"] == 20


def two_nodes(port: int, *argv: str) -> list[subprocess.CompletedProcess]:
    """The README's multi-node command, run as two nodes on this machine: two torchrun agents
    meeting at a c10d rendezvous, one training process each."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
           f"fasttrain-{port}", "-m", "fasttrain", *map(str, argv)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    return done


@pytest.mark.slow
def test_two_nodes_through_torchruns_rendezvous_train_checkpoint_and_resume(tiny_data, tmp_path):
    """Two "nodes" (torchrun --nnodes 2 with c10d) train 4 steps, checkpoint, and resume with
    --resume auto to step 8: the weights equal one node's two processes on the same global
    batch, uninterrupted, bit for bit (the BN running statistics, averaged over the ranks at
    each checkpoint, to rounding)."""
    common = ["--data", tiny_data, *FAST, "--batch-size", "8", "--eval-every", "0"]
    out = tmp_path / "nodes"
    for extra in (["--max-steps", "4"], ["--max-steps", "8", "--resume", "auto"]):
        runs = two_nodes(free_port(), *common, *extra, "--output-dir", out)
        assert [r.returncode for r in runs] == [0, 0], (
            runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
        )
    log = (out / "log-rank0.txt").read_text()
    assert "resumed from" in log and "8 per process x 2 processes" in log
    one = tmp_path / "one"
    r = launch("--nproc-per-node", "2", *common, "--max-steps", "8", "--output-dir", one)
    assert r.returncode == 0, r.stderr[-3000:]
    nodes, single = last_checkpoint(out), last_checkpoint(one)
    assert nodes["step"] == single["step"] == 8
    for k, v in single["model"].items():
        if "running_" in k:  # averaged over ranks at step 4 too: the same EMA, other roundings
            torch.testing.assert_close(nodes["model"][k], v, rtol=1e-5, atol=1e-7, msg=k)
        else:  # weights: bit for bit
            assert torch.equal(nodes["model"][k], v), k


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_with_an_error_not_a_hang(tiny_data, tmp_path):
    """SIGKILL one of two ranks mid-run: the launch exits non-zero within the timeout, saying a
    training process failed, and the checkpoints written before stay loadable."""
    import re
    import signal

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fasttrain",
            "--nproc-per-node",
            "2",
            "--data",
            str(tiny_data),
            *map(str, FAST),
            "--device",
            "cpu",
            "--batch-size",
            "8",
            "--max-steps",
            "400",
            "--eval-every",
            "0",
            "--log-every",
            "1",
            "--ckpt-every-steps",
            "3",
            "--dist-timeout",
            "20",
            "--output-dir",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 180
    pid = None
    while time.monotonic() < deadline and pid is None:
        log1 = out / "log-rank1.txt"
        done = (
            (out / "metrics.jsonl").read_text().count('"train"')
            if (out / "metrics.jsonl").is_file()
            else 0
        )
        if log1.is_file() and done >= 4:
            pid = int(re.search(r"rank 1 of 2: process (\d+)", log1.read_text()).group(1))
        time.sleep(0.1)
    assert pid is not None, "the run did not get going"
    os.kill(pid, signal.SIGKILL)
    t = time.monotonic()
    code = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert code != 0 and time.monotonic() - t < 60
    assert "a training process failed" in err
    assert last_checkpoint(out)["step"] >= 3  # written before the kill, and loadable


@pytest.mark.slow
def test_lars_trains_under_ddp_on_the_cpu(tiny_data, tmp_path):
    """--opt lars in torch's foreach ops: two gloo processes train with DDP's buckets, and the
    two ranks hold the same weights (one checkpoint, written after both stepped alike)."""
    out = tmp_path / "lars"
    r = launch("--nproc-per-node", "2", "--data", tiny_data, *FAST, "--batch-size", "8",
               "--opt", "lars", "--max-steps", "6", "--eval-every", "0", "--log-every", "2",
               "--output-dir", out)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(v == v for v in losses)
    assert last_checkpoint(out)["step"] == 6


@pytest.mark.slow
def test_evaluate_on_two_processes_counts_every_image_once(tiny_data, tmp_path):
    """``evaluate --nproc-per-node 2``: each rank evaluates its shard, the counts are summed,
    and the figures are one process's."""
    train = tmp_path / "train"
    r = launch("--data", tiny_data, *FAST, "--max-steps", "3", "--eval-every", "0",
               "--output-dir", train)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    checkpoint = next(train.glob("ckpt-*.pt"))
    results = {}
    for procs in (1, 2):
        out = tmp_path / f"eval{procs}"
        r = launch("evaluate", checkpoint, "--nproc-per-node", str(procs), "--data", tiny_data,
                   *FAST, "--output-dir", out)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        results[procs] = json.loads((out / "eval.json").read_text())
    assert results[1]["images"] == results[2]["images"] == 100
    assert results[2]["top1"] == pytest.approx(results[1]["top1"])
    assert results[2]["top5"] == pytest.approx(results[1]["top5"])


def _fused_bn_worker(rank: int, world: int, port: int, out: str) -> None:
    """Two DDP steps of the fused ResNet on this rank's own batch, then the BN averaging that
    precedes evaluation and checkpoints."""
    from fasttrain.dist.parallel import average_bn_statistics
    from fasttrain.model.fused_resnet import FusedResNet

    dist = join(rank, world, port, timeout_s=120)
    torch.manual_seed(0)
    model = FusedResNet("resnet18", num_classes=4).to(memory_format=torch.channels_last)
    net = wrap_model(model, TrainConfig(strategy="ddp"), dist).net
    step = sgd_step(model, net)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own images
    meter = DeviceMeter(torch.device("cpu"), dist)
    for i in range(2):
        x = torch.randn(4, 3, 32, 32, generator=g).contiguous(memory_format=torch.channels_last)
        step([(x, torch.randint(0, 4, (4,), generator=g))], meter, i)

    def stats() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}

    before = dist.all_gather_object(stats())
    average_bn_statistics(model, dist)
    after = dist.all_gather_object(stats())
    if rank == 0:
        torch.save({"before": before, "after": after}, out)
    del step, net
    dist.close()


def test_fused_bn_ranks_keep_their_own_statistics_and_average_them_for_checkpoints(tmp_path):
    """--fused-bn under DDP: each rank's BatchNorm running statistics follow its own batches (the
    fused path's finalize updates them), and the averaging before evaluation and checkpoints
    leaves every rank with their mean."""
    out = tmp_path / "fused.pt"
    mp.spawn(_fused_bn_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    (a, b), (a_avg, b_avg) = got["before"], got["after"]
    assert a.keys() == b.keys() and len(a) == 2 * 20  # resnet18: 20 BatchNorms
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the ranks' statistics differ
    for k in a:
        torch.testing.assert_close(a_avg[k], (a[k] + b[k]) / 2)
        assert torch.equal(a_avg[k], b_avg[k])
