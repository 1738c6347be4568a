"""On GPUs (``gpu``): the trainer through its CLI on one GPU, and, where two are present, DDP over
NCCL with the whole step in a CUDA graph against one process on the same global batch, and
``--strategy dp``. The two-GPU tests skip, saying so, where only one GPU is visible."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from fasttrain.config import OptimConfig, TrainConfig
from fasttrain.dist.parallel import wrap_model
from fasttrain.dist.state import DistState
from fasttrain.metrics.meter import DeviceMeter
from fasttrain.step.optim import build_optimizer
from fasttrain.step.step import GraphedStep, build_step
from tests.conftest import constant_lr
from tests.dist.test_dist import GLOBAL_BATCH, free_port, tiny_net

pytestmark = pytest.mark.gpu
TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two GPUs (one is visible, or none)",
)
STEPS = 16  # past DDP's 11 warm-up steps: the rest replay the captured graph
GPU_FLAGS = ["--arch", "resnet18", "--image-size", "64", "--batch-size", "16", "--workers", "2",
             "--loader", "torchvision"]  # fmt: skip


def _nccl_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    dist = DistState.from_env("cuda", timeout_s=120)
    torch.manual_seed(0)
    model = tiny_net().to(dist.device).to(memory_format=torch.channels_last)
    t = TrainConfig(strategy="ddp" if world > 1 else "none", cuda_graphs=True)
    wrapped = wrap_model(model, t, dist)
    step = build_step(
        model=wrapped.net,
        optimizer=build_optimizer(model, OptimConfig(), 0.1),
        criterion=nn.CrossEntropyLoss(),
        amp_dtype=torch.bfloat16,
        scaler=None,
        schedule=constant_lr(0.1),
        compile=False,
        cuda_graphs=True,
        side_stream=wrapped.side_stream,
    )
    meter = DeviceMeter(dist.device, dist)
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=g)
        y = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
        share = x[rank::world].to(dist.device).contiguous(memory_format=torch.channels_last)
        step([(share, y[rank::world].to(dist.device))], meter, i)
        losses.append(meter.flush()[0])
    assert isinstance(step, GraphedStep) and step.graph is not None and not step.capture_failed
    flat = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
    every_rank = dist.all_gather_object(flat)
    if rank == 0:
        torch.save({"losses": losses, "params": every_rank}, out)
    del step, wrapped
    dist.close()


@TWO_GPUS
def test_nccl_ddp_inside_the_cuda_graph_matches_one_process(tmp_path):
    """DDP's all-reduce captured with the whole step and replayed: the two ranks hold the same
    weights, and they are those of one process on the same global batch (bf16: close, not
    equal)."""
    got = {}
    for world in (1, 2):
        out = tmp_path / f"world{world}.pt"
        mp.spawn(_nccl_worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
        got[world] = torch.load(out)
    a, b = got[2]["params"]
    assert torch.equal(a, b)
    torch.testing.assert_close(a, got[1]["params"][0], rtol=2e-2, atol=2e-3)
    assert got[2]["losses"] == pytest.approx(got[1]["losses"], rel=3e-2)


@TWO_GPUS
def test_strategy_dp_trains_on_every_visible_gpu(run, tiny_data, tmp_path):
    out = tmp_path / "dp"
    code, err = run("--data", tiny_data, *GPU_FLAGS, "--strategy", "dp", "--max-steps", "4",
                    "--eval-every", "0", "--output-dir", out)  # fmt: skip
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gpus"] == torch.cuda.device_count() and summary["steps"] == 4
    assert len(summary["peak_mem_gib_per_gpu"]) == summary["gpus"]


def test_a_gpu_run_through_the_cli_compiles_captures_and_learns(run, tiny_data, tmp_path):
    """The trainer as a user starts it on a GPU: the default BatchNorm path for this GPU (named
    on the start-up line), the compiled step captured in a CUDA graph, the loss falling, and a
    checkpoint that resumes."""
    out = tmp_path / "gpu"
    common = ["--data", tiny_data, *GPU_FLAGS, "--compile", "--cuda-graphs", "--epochs", "3",
              "--log-every", "3", "--output-dir", out]  # fmt: skip
    code, err = run(*common)
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert "captured the training step in a CUDA graph" in log
    assert "BatchNorm folded into the convolutions (--fused-bn auto)" in log or (
        "BatchNorm plain (--fused-bn auto:" in log
    )
    losses = [r["loss"] for r in run.records(out, "train")]
    assert losses[-1] < losses[0] and all(r["nonfinite_losses"] == 0
                                          for r in run.records(out, "train"))  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["capture_s"] is not None and summary["val"]["top1"] >= 0
    code, err = run(*common, "--epochs", "4", "--resume", "auto")
    assert code == 0, err
    assert "resumed from" in (Path(out) / "log-rank0.txt").read_text()
