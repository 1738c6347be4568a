"""What ResNet-50's stem (7x7 conv, BN, ReLU, 3x3 max-pool) costs on the GPU, forward + backward,
and what padding the input's 3 channels to 4 or 8 changes. A profile of the compiled step put
about 4 ms of its 38 in the stem (the conv's forward and weight gradient, the max-pool's
backward); this splits that up, one case at a time, in one process.

Usage on the GPU machine: python bench/stem.py [--batch 256]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from common import block_ms  # bench/common.py: the script's folder is on sys.path
from torch import nn

from fasttrain.distributed import claim_hardware_queues


def timed_ms(fn: Callable[[], None]) -> float:
    """Median over 5 blocks of the mean ms per call of 20 calls, after 5 warm-up calls."""
    return statistics.median(block_ms(fn, warmup=5, block=20, blocks=5))


class Stem(nn.Module):
    """torchvision ResNet's stem; the conv's weight keeps 3 input channels and is zero-padded
    to the input's channel count in forward, as a padded model would do."""

    def __init__(self, pool: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.conv1.weight
        if x.shape[1] > w.shape[1]:
            w = F.pad(w, (0, 0, 0, 0, 0, x.shape[1] - w.shape[1]))
        y = F.relu(self.bn1(F.conv2d(x, w, None, 2, 3)))
        return F.max_pool2d(y, 3, 2, 1) if self.pool else y


def conv_fb(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> None:
    w.grad = None
    F.conv2d(x, w, None, 2, 3).backward(g)


def stem_fb(stem: nn.Module, fwd: Callable, x: torch.Tensor, g: torch.Tensor) -> None:
    for q in stem.parameters():
        q.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fwd(x)
    out.backward(g)


def pool_fb(pool: Callable, y: torch.Tensor, g: torch.Tensor) -> None:
    y.grad = None
    pool(y).backward(g)


def main() -> None:
    claim_hardware_queues()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    dev, n = torch.device("cuda"), args.batch
    cl = torch.channels_last
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | batch {n}, bf16, NHWC")
    print("| case | channels | ms per call |")
    print("|---|---:|---:|")

    def row(case: str, ch: int | str, fn: Callable[[], None]) -> None:
        print(f"| {case} | {ch} | {timed_ms(fn):.3f} |", flush=True)

    for c in (3, 4, 8):
        x = torch.randn(n, c, 224, 224, device=dev, dtype=torch.bfloat16).to(memory_format=cl)
        if c > 3:
            x[:, 3:] = 0
        w = torch.randn(64, c, 7, 7, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w.data = w.data.to(memory_format=cl)
        g = torch.randn(n, 64, 112, 112, device=dev, dtype=torch.bfloat16).to(memory_format=cl)
        row("conv 7x7 forward (cuDNN)", c, partial(F.conv2d, x, w, None, 2, 3))
        row("conv 7x7 forward + weight gradient (cuDNN)", c, partial(conv_fb, x, w, g))
        gp = torch.randn(n, 64, 56, 56, device=dev, dtype=torch.bfloat16).to(memory_format=cl)
        for kind in ("eager", "compiled"):
            stem = Stem().to(dev).to(memory_format=cl)
            fwd = torch.compile(stem, dynamic=False) if kind == "compiled" else stem
            row(f"stem forward + backward ({kind})", c, partial(stem_fb, stem, fwd, x, gp))

    # the max-pool alone, on the stem's ReLU output
    y = torch.randn(n, 64, 112, 112, device=dev, dtype=torch.bfloat16).to(memory_format=cl)
    y.requires_grad_(True)
    gp = torch.randn(n, 64, 56, 56, device=dev, dtype=torch.bfloat16).to(memory_format=cl)
    pools = {
        "eager": lambda t: F.max_pool2d(t, 3, 2, 1),
        "compiled": torch.compile(lambda t: F.max_pool2d(t, 3, 2, 1), dynamic=False),
    }
    for kind, pool in pools.items():
        row(f"max-pool 3x3/2 forward ({kind})", 64, partial(pool, y))
        row(f"max-pool 3x3/2 forward + backward ({kind})", 64, partial(pool_fb, pool, y, gp))


if __name__ == "__main__":
    main()
