"""Where DALI's end-to-end cost goes: one compiled + graphed ResNet-50 step (batch 256, bf16) fed
by synthetic data and by DALI under each loader setting, side by side in one process; DALI
alone, and DALI pulled while the step trains on synthetic data; then a trace of each feed with
where the GPU idles and what the host threads wait on.

Usage on the GPU machine: python bench/dali_e2e.py [DATA_DIR]
[--set handoff|executor|priority|clocks|resize] [--inductor-options coordinate_descent_tuning]
[--maxpool] [--no-trace] [--jsonl FILE] [--marks FILE] (default data: the sample dataset).
``--set handoff`` (the default) compares DALI's prefetch
depth and how a batch reaches the step; ``executor`` the third session's executor settings;
``priority`` the step replayed on a high-priority stream, so that DALI's decode kernels take SMs
only where the step leaves them free (measured: no difference); ``clocks`` synthetic against DALI
twice, with ``--marks`` for lining the windows up with nvidia-smi's SM clock and power log;
``resize`` the train resize with and without its antialiasing filter (less DALI work beside the
step). Each trace also lists the GPU work off the training stream by kernel name.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from datetime import datetime

import torch
from common import loader_args  # bench/common.py: the script's folder is on sys.path
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fasttrain.config import OptimConfig, cache_dir, inductor_options
from fasttrain.data.dali import DaliLoader
from fasttrain.data.folder import scan_folder
from fasttrain.data.sample import build_sample
from fasttrain.distributed import claim_hardware_queues
from fasttrain.metrics import DeviceMeter
from fasttrain.model import build_model
from fasttrain.optim import build_optimizer, build_schedule
from fasttrain.step import build_step, compile_kwargs

BATCH, SIZE = 256, 224
TRACE_DIR = os.environ.get("TRACE_DIR", "/tmp/bench")


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


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="?", help="dataset root (default: the sample dataset)")
    p.add_argument(
        "--set",
        choices=("handoff", "executor", "priority", "clocks", "resize"),
        default="handoff",
    )
    p.add_argument(
        "--inductor-options",
        default="",
        help="as the trainer's --inductor-options, e.g. coordinate_descent_tuning (what "
        "--compile-mode auto adds on a GPU)",
    )
    p.add_argument("--maxpool", action="store_true", help="the Triton max-pool in the stem")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per variant")
    p.add_argument("--no-trace", action="store_true", help="skip the profiled traces at the end")
    p.add_argument("--only-trace", action="store_true", help="only the traces, no timed variants")
    p.add_argument("--jsonl", help="append each variant's img/s to this file")
    p.add_argument(
        "--marks",
        help="append each timed window (variant, start, end: local wall-clock time) to this "
        "file, to line up with a clock and power log (nvidia-smi --query-gpu=timestamp,...)",
    )
    return p.parse_args()


def main() -> None:
    args = parse()
    claim_hardware_queues()  # as the trainer does (CUDA_DEVICE_MAX_CONNECTIONS), unless set
    root = args.data or build_sample(cache_dir())
    samples = scan_folder(root).train
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    model = build_model("resnet50", 10, True, dev, triton_maxpool=args.maxpool)
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
        compile_options=compile_kwargs("default", inductor_options(args.inductor_options)),
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

    side = torch.cuda.Stream(dev)  # a non-default stream: no implicit sync with blocking streams

    def rate(
        loader, epochs: int = args.epochs, stream: torch.cuda.Stream | None = None
    ) -> tuple[float, list[datetime]]:
        """img/s over ``epochs`` after one untimed epoch, and the timed window (for --marks)."""
        with torch.cuda.stream(stream or torch.cuda.default_stream(dev)):
            epoch(loader, 0)
            torch.cuda.synchronize()
            start, t = datetime.now(), time.perf_counter()
            images = sum(epoch(loader, e) for e in range(1, epochs + 1))
            torch.cuda.synchronize()
        return images / (time.perf_counter() - t), [start, datetime.now()]

    def dali(**kw) -> DaliLoader:
        a: dict = dict(threads=8, hw_decoder_load=0.99, prefetch=2, handoff="host")
        a.update(kw)
        return DaliLoader(samples, local_rank=0, **loader_args(BATCH, SIZE, dev), **a)

    t0 = time.perf_counter()
    rate(Fixed(10), epochs=1)  # compile, warm-up and capture
    print(f"compile + capture: {time.perf_counter() - t0:.0f} s", flush=True)

    per_epoch = len(samples) // BATCH
    synthetic = (lambda: Fixed(per_epoch), None)
    if args.set == "handoff":  # fasttrain's default first, synthetic at both ends for drift
        variants = {  # name: (loader, training stream)
            "synthetic (fp16, one buffer)": synthetic,
            "dali, prefetch 2 (DALI's default), host hand-off": (lambda: dali(), None),
            "dali, prefetch 3": (lambda: dali(prefetch=3), None),
            "dali, prefetch 4 (fasttrain's default)": (lambda: dali(prefetch=4), None),
            "dali, stream hand-off": (lambda: dali(handoff="stream"), None),
            "dali, stream hand-off, prefetch 4": (lambda: dali(handoff="stream", prefetch=4), None),
            "dali, prefetch 2, host hand-off, again": (lambda: dali(), None),
            "synthetic, again": synthetic,
        }
    elif args.set == "priority":  # the step on a high-priority stream: DALI's kernels yield
        hi = torch.cuda.Stream(dev, priority=-5)  # clamped to the device's highest
        variants = {
            "synthetic (fp16, one buffer)": synthetic,
            "synthetic, high-priority stream": (lambda: Fixed(per_epoch), hi),
            "dali, prefetch 4": (lambda: dali(prefetch=4), None),
            "dali, prefetch 4, high-priority stream": (lambda: dali(prefetch=4), hi),
            "dali, prefetch 4, again": (lambda: dali(prefetch=4), None),
            "dali, prefetch 4, high-priority stream, again": (lambda: dali(prefetch=4), hi),
            "synthetic, again": synthetic,
        }
    elif args.set == "resize":  # less DALI work beside the step: no antialiasing filter
        variants = {
            "synthetic (fp16, one buffer)": synthetic,
            "dali, prefetch 4 (antialiased resize)": (lambda: dali(prefetch=4), None),
            "dali, prefetch 4, resize without antialiasing": (
                lambda: dali(prefetch=4, antialias=False),
                None,
            ),
            "dali, prefetch 4 (antialiased resize), again": (lambda: dali(prefetch=4), None),
            "dali, prefetch 4, resize without antialiasing, again": (
                lambda: dali(prefetch=4, antialias=False),
                None,
            ),
            "synthetic, again": synthetic,
        }
    elif args.set == "clocks":  # SM clock and power beside DALI (read from --marks' windows)
        variants = {
            "synthetic (fp16, one buffer)": synthetic,
            "dali, prefetch 4": (lambda: dali(prefetch=4), None),
            "synthetic, again": synthetic,
            "dali, prefetch 4, again": (lambda: dali(prefetch=4), None),
        }
    else:
        variants = {
            "synthetic (fp16, one buffer)": synthetic,
            "synthetic, side stream": (lambda: Fixed(per_epoch), side),
            "dali, hw 0.99, 8 threads": (lambda: dali(), None),
            "dali, hw 0.99, 8 threads, side stream": (lambda: dali(), side),
            "dali, hw 0.65, 16 threads": (lambda: dali(hw_decoder_load=0.65, threads=16), None),
            "dali, hw 0.65, 16 threads, side stream": (
                lambda: dali(hw_decoder_load=0.65, threads=16),
                side,
            ),
            "dali, hw 0.3, 16 threads": (lambda: dali(hw_decoder_load=0.3, threads=16), None),
            "dali, 2 pipelines, side stream": (lambda: dali(pipelines=2), side),
        }
    results = {}
    if args.only_trace:
        variants = {}
    for name, (make, stream) in variants.items():
        try:
            loader = make()
            results[name], window = rate(loader, stream=stream)
        except Exception as e:  # a variant this DALI build refuses: say so, go on
            print(f"{name:48s} failed: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        print(f"{name:48s} {results[name]:8,.0f} img/s", flush=True)
        mark(args.marks, name, window)
        del loader

    if not args.only_trace:
        alone_and_pulled(results, dali(), Fixed(per_epoch), step, meter, n, args.marks)
        report(results, args.jsonl)
    if args.no_trace:
        return

    # one trace per feed, 12 steps each, for the timeline: where the GPU idles, what DALI's
    # threads wait on, and (against synthetic data) how much GPU time DALI's own kernels take
    traced = (
        (
            ("synthetic", Fixed(per_epoch), None),
            ("dali-prefetch2", dali(), None),
            ("dali-prefetch4", dali(prefetch=4), None),
        )
        if args.set == "handoff"
        else (
            ("synthetic", Fixed(per_epoch), None),
            ("dali-prefetch4", dali(prefetch=4), None),
            ("dali-prefetch4-no-antialias", dali(prefetch=4, antialias=False), None),
        )
        if args.set == "resize"
        else (("dali", dali(), None), ("dali-side", dali(), side))
    )
    for name, loader, stream in traced:
        with torch.cuda.stream(stream or torch.cuda.default_stream(dev)):
            epoch(loader, 0)
            loader.set_epoch(1)
            batches = iter(loader)
            for _ in range(10):  # past the epoch's start: the trace is of steady steps
                step([next(batches)], meter, n[0])
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(12):
                    step([next(batches)], meter, n[0])
                torch.cuda.synchronize()
        path = f"{TRACE_DIR}/{name}.json"
        prof.export_chrome_trace(path)
        print(f"\n== {name}: {path}")
        summarize(path, steps=12)


def mark(path: str | None, name: str, window: list[datetime]) -> None:
    if path:
        with open(path, "a") as f:
            start, end = (t.strftime("%Y/%m/%d %H:%M:%S.%f") for t in window)
            f.write(json.dumps({"variant": name, "start": start, "end": end}) + "\n")


def alone_and_pulled(
    results: dict, loader, fixed, step, meter, n: list[int], marks: str | None = None
) -> None:
    """The two halves apart: DALI alone, and DALI pulled while the step trains on synthetic
    data (the same GPU load, without the data dependency)."""

    def alone(e: int) -> int:
        loader.set_epoch(e)
        return sum(x.shape[0] for x, _ in loader)

    def pulled(e: int) -> int:
        loader.set_epoch(e)
        images = 0
        for (x, _), (fx, fy) in zip(loader, fixed, strict=False):  # len(loader) steps
            step([(fx, fy)], meter, n[0])
            n[0] += 1
            images += x.shape[0]
        return images

    for name, fn in (
        ("dali alone (no step)", alone),
        ("dali pulled, step on synthetic", pulled),
    ):
        fn(0)
        torch.cuda.synchronize()
        start, t = datetime.now(), time.perf_counter()
        images = sum(fn(e) for e in range(1, 4))
        torch.cuda.synchronize()
        results[name] = images / (time.perf_counter() - t)
        print(f"{name:48s} {results[name]:8,.0f} img/s", flush=True)
        mark(marks, name, [start, datetime.now()])


def report(results: dict[str, float], jsonl: str | None) -> None:
    """The table against synthetic data (the mean where it ran at both ends)."""
    synth = [r for name, r in results.items() if name.startswith("synthetic")]
    base = sum(synth) / len(synth)
    print(f"\n| feed | img/s | vs synthetic ({base:,.0f}) |\n|---|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r:,.0f} | {100 * (r / base - 1):+.1f}% |")
    if jsonl:
        with open(jsonl, "a") as f:
            for name, r in results.items():
                f.write(json.dumps({"feed": name, "img_s": r, "vs_synthetic": r / base - 1}) + "\n")


def summarize(path: str, steps: int) -> None:
    """GPU busy and idle per step, busy time per stream, and host time spent in CUDA
    synchronisation calls per thread, from a chrome trace."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu.sort(key=lambda e: e["ts"])
    t0, t1 = gpu[0]["ts"], max(e["ts"] + e["dur"] for e in gpu)
    busy, end = 0.0, t0
    gaps = []
    for e in gpu:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > end:
            gaps.append((s - end, e))
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    span = t1 - t0
    print(
        f"window {span / 1e3:.1f} ms, GPU busy {busy / 1e3 / steps:.2f} ms/step, "
        f"idle {(span - busy) / 1e3 / steps:.2f} ms/step"
    )
    big = sorted(gaps, key=lambda g: -g[0])[:8]
    print("largest idle gaps (ms, and the event that ended each: the first after it):")
    for g, e in big:
        print(f"  {g / 1e3:6.2f}  stream {e['args'].get('stream')}  {e['name'][:90]}")
    per_stream = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        acc = per_stream[e["args"].get("stream")]
        acc[0] += e["dur"]
        acc[1] += 1
    print("per stream: ms/step, events/step")
    for st, (d, c) in sorted(per_stream.items(), key=lambda kv: -kv[1][0]):
        print(f"  stream {st}: {d / 1e3 / steps:7.2f}  {c / steps:7.1f}")
    # what the loader's GPU work is made of: every event off the busiest (the training) stream
    training = max(per_stream, key=lambda st: per_stream[st][0])
    per_name = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        if e["args"].get("stream") != training:
            acc = per_name[e["name"][:100]]
            acc[0] += e["dur"]
            acc[1] += 1
    print(f"off the training stream ({training}), by kernel or copy: ms/step, events/step")
    for nm, (d, c) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"  {d / 1e3 / steps:7.3f}  {c / steps:6.1f}  {nm}")
    syncs = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and (
            "ynchronize" in e["name"] or "Query" in e["name"] or "Wait" in e["name"]
        ):
            acc = syncs[(e["tid"], e["name"])]
            acc[0] += e["dur"]
            acc[1] += 1
    print("host sync/wait calls per thread: ms/step, calls/step")
    for (tid, nm), (d, c) in sorted(syncs.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  tid {tid}: {nm:32s} {d / 1e3 / steps:7.2f}  {c / steps:6.1f}")


if __name__ == "__main__":
    main()
