"""Where DALI's end-to-end cost goes: one compiled + graphed ResNet-50 step (batch 256, bf16) fed
by synthetic data and by DALI with each batch hand-off, side by side in one process; then a
profile of synthetic vs DALI steps (kernel time per step, and the kernels only DALI runs).

Usage on the GPU machine: python bench/dali_e2e.py [DATA_DIR]  (default: the sample dataset)
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from common import loader_args  # bench/common.py: the script's folder is on sys.path
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fasttrain.config import OptimConfig, cache_dir
from fasttrain.data.dali import DaliLoader
from fasttrain.data.folder import scan_folder
from fasttrain.data.sample import build_sample
from fasttrain.metrics import DeviceMeter
from fasttrain.model import build_model
from fasttrain.optim import build_optimizer, build_schedule
from fasttrain.step import build_step

BATCH, SIZE = 256, 224


class Fixed:
    """Synthetic fp16 batches in one buffer, as DALI hands them over."""

    def __init__(self, steps: int):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH, SIZE, SIZE, 3, generator=g).to("cuda", torch.float16)
        self.x = x.permute(0, 3, 1, 2)
        self.y = torch.randint(0, 10, (BATCH,), generator=g).cuda()
        self.steps = steps

    def __len__(self):
        return self.steps

    def set_epoch(self, epoch, start_batch=0):
        pass

    def __iter__(self):
        for _ in range(self.steps):
            yield self.x, self.y


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else build_sample(cache_dir())
    samples = scan_folder(root).train
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    model = build_model("resnet50", 10, True, dev)
    cfg = OptimConfig(warmup_epochs=1, lr_schedule="cosine", label_smoothing=0.1)
    schedule = build_schedule(cfg, BATCH, 39, 100)
    step = build_step(
        model=model,
        optimizer=build_optimizer(model, cfg, schedule.lr_at(0)),
        criterion=nn.CrossEntropyLoss(label_smoothing=0.1),
        amp_dtype=torch.bfloat16,
        scaler=None,
        schedule=schedule,
        compile=True,
        cuda_graphs=True,
    )
    meter = DeviceMeter(dev)
    n = [0]

    def epoch(loader, e: int) -> int:
        loader.set_epoch(e)
        images = 0
        for x, y in loader:
            step([(x, y)], meter, n[0])
            n[0] += 1
            images += x.shape[0]
        return images

    def rate(loader, epochs: int = 3) -> float:
        epoch(loader, 0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        images = sum(epoch(loader, e) for e in range(1, epochs + 1))
        torch.cuda.synchronize()
        return images / (time.perf_counter() - t)

    def dali(**kw) -> DaliLoader:
        args = dict(threads=8, hw_decoder_load=0.99, prefetch=2, handoff="host")
        args.update(kw)
        return DaliLoader(samples, local_rank=0, **loader_args(BATCH, SIZE, dev), **args)

    t0 = time.perf_counter()
    rate(Fixed(10), epochs=1)  # compile, warm-up and capture
    print(f"compile + capture: {time.perf_counter() - t0:.0f} s", flush=True)
    variants = {
        "synthetic (fp16, one buffer)": lambda: Fixed(len(samples) // BATCH),
        "dali host-sync, prefetch 2": lambda: dali(),
        "dali host-sync, prefetch 4": lambda: dali(prefetch=4),
        "dali stream-ordered, prefetch 2": lambda: dali(handoff="stream"),
        "dali copy stream, prefetch 2": lambda: dali(handoff="copy_stream"),
        "dali copy stream, prefetch 4": lambda: dali(handoff="copy_stream", prefetch=4),
        "dali host-sync, 12 threads": lambda: dali(threads=12),
    }
    results = {}
    for name, make in variants.items():
        loader = make()
        results[name] = rate(loader)
        print(f"{name:40s} {results[name]:8,.0f} img/s", flush=True)
        del loader
    base = results["synthetic (fp16, one buffer)"]
    print("\n| feed | img/s | vs synthetic |\n|---|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r:,.0f} | {100 * (r / base - 1):+.1f}% |")

    # kernel time per step, synthetic vs DALI (host-sync), 10 profiled steps each
    per_kernel = {}
    for name, loader in (("synthetic", Fixed(20)), ("dali", dali())):
        epoch(loader, 0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loader.set_epoch(1)
            for i, (x, y) in enumerate(loader):
                if i == 10:
                    break
                step([(x, y)], meter, n[0])
            torch.cuda.synchronize()
        totals = defaultdict(float)
        for ev in prof.key_averages():
            if ev.device_time_total > 0 and ev.device_type.name == "CUDA":
                totals[ev.key] += ev.device_time_total / 10 / 1e3  # ms per step
        per_kernel[name] = totals
        print(f"\n{name}: {sum(totals.values()):.2f} ms of GPU kernels and copies per step")
    only = {k: v for k, v in per_kernel["dali"].items() if k not in per_kernel["synthetic"]}
    print("kernels only in the DALI run (ms per step):")
    for k, v in sorted(only.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {v:7.3f}  {k[:110]}")


if __name__ == "__main__":
    main()
