"""Side by side on one GPU, in one process: a plain eager ResNet-50 loop vs the same loop with each
of fasttrain's per-step extras added, to account for any gap to the baseline in
../shared/device/README.md (4,704 img/s eager, bf16, channels_last, batch 256).

Each variant: 30 warm-up steps, then the median of 6 blocks of 25 steps (CUDA events; common.py).
Usage on the GPU machine: python bench/eager_overhead.py
"""

from __future__ import annotations

import torch
import torchvision
from common import timed as timed_blocks  # bench/common.py: the script's folder is on sys.path
from torch import nn

from fasttrain.config import OptimConfig
from fasttrain.metrics import DeviceMeter
from fasttrain.optim import build_optimizer, build_schedule
from fasttrain.step import EagerStep

BATCH = 256
CONSTANT_LR = build_schedule(OptimConfig(lr_step_epochs=10**6), BATCH, 10**6, 1)  # 0.1 throughout


def timed(step_fn) -> float:
    return timed_blocks(step_fn, BATCH)[0]


def main() -> None:
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    x = torch.randn(BATCH, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (BATCH,), device=dev)
    crit = nn.CrossEntropyLoss()

    def fresh():
        torch.manual_seed(0)
        m = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
        return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    results = {}
    m, opt = fresh()

    def plain_loop(set_to_none: bool):
        """The baseline's loop: fp32 input, autocast bf16; only how grads are cleared varies."""

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                loss = crit(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)

        return step

    results["plain loop (zero_grad to None)"] = timed(plain_loop(set_to_none=True))
    results["+ grads zeroed in place"] = timed(plain_loop(set_to_none=False))

    m, _ = fresh()
    opt = build_optimizer(m, OptimConfig(), 0.1)
    step = EagerStep(m, opt, crit, torch.bfloat16, None, CONSTANT_LR)
    meter = DeviceMeter(dev)
    xb = x.to(torch.bfloat16)
    # fused SGD, the LR set from the host each step, metrics accumulated on the device
    results["fasttrain EagerStep (bf16 input)"] = timed(lambda: step([(xb, y)], meter, 0))
    base = next(iter(results.values()))
    print(f"{'variant':45s} {'img/s':>8s} {'vs plain':>9s}")
    for name, rate in results.items():
        print(f"{name:45s} {rate:8,.0f} {100 * (rate / base - 1):+8.1f}%")


if __name__ == "__main__":
    main()
