"""GPU-only checks (skipped without CUDA): no host syncs on non-log steps, on the real step code."""

import pytest
import torch
from torch import nn

from fasttrain.config import OptimConfig
from fasttrain.data.folder import scan_folder
from fasttrain.data.synthetic import SyntheticLoader
from fasttrain.metrics import DeviceMeter
from fasttrain.model import build_model
from fasttrain.optim import build_optimizer, build_schedule, set_lr
from fasttrain.step import build_step
from tests.conftest import train_loader

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compile", [False, True])
def test_steady_state_steps_do_not_sync(compile):
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = build_model("resnet18", 10, channels_last=True, device=device)
    schedule = build_schedule(OptimConfig(warmup_epochs=1, lr_schedule="cosine"), 32, 10, 3)
    optimizer = build_optimizer(model, OptimConfig(), schedule.lr_at(0))
    step = build_step(
        compile, model, optimizer, nn.CrossEntropyLoss(label_smoothing=0.1), torch.bfloat16, None
    )
    loader = SyntheticLoader(
        batch_size=32,
        image_size=64,
        num_classes=10,
        steps=30,
        device=device,
        dtype=torch.bfloat16,
        channels_last=True,
        seed=0,
    )
    meter = DeviceMeter(device)
    batches = iter(loader)
    for i in range(3):  # warm-up: compile, cuDNN autotuning, allocator growth
        set_lr(optimizer, schedule.lr_at(i))
        step([next(batches)], meter)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 23):  # the loop's per-step work between two log steps
            set_lr(optimizer, schedule.lr_at(i))
            step([next(batches)], meter)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    loss, top1, n = meter.flush()  # the log step: the one sync
    assert n == 23 * 32 and loss == loss and 0 <= top1 <= 100


def test_torchvision_loader_copies_without_syncing(tiny_data):
    samples = scan_folder(tiny_data).train
    loader = train_loader(samples, workers=2, device="cuda", dtype=torch.bfloat16)
    loader.set_epoch(0)
    n = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # after construction: only iteration is steady state
    try:
        for x, y in loader:
            assert x.is_cuda and x.dtype == torch.bfloat16 and y.dtype == torch.int64
            assert x.is_contiguous(memory_format=torch.channels_last)
            n += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert n == len(loader)
