"""conv_bn's forward, layer by layer: for each kind of convolution in a ResNet, what cuDNN's fused
kernel (prologue + conv + statistics) costs against the bare convolution and against the same
work done unfused (the prologue as an elementwise pass, the conv, the statistics as a
reduction: conv_bn's reference, eager), in fp16 channels_last, timed as device time from CUDA
graph replays. Writes a markdown table, each row weighted by how often the
model runs that convolution, and the totals.

Usage: python bench/conv_bn_layers.py [--arch resnet50] [--batch 256] [--image-size 224]
Needs a GPU and ``pip install nvidia-cudnn-frontend``.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import torch
import torch.nn.functional as F
import torchvision

from fasttrain.model.cudnn import conv_bn as cudnn_conv_bn
from fasttrain.model.ops.conv_bn import reference


def layers(arch: str, size: int) -> Counter:
    """(c, k, kernel, stride, padding, input size, prologue) of every convolution, counted. A
    block's second and third convolutions read the BN before them (the prologue)."""
    model = getattr(torchvision.models, arch)(weights=None).eval()
    seen: Counter = Counter()

    def hook(name):
        def record(conv, inputs, _):
            x = inputs[0]
            prologue = name.endswith(("conv2", "conv3"))
            seen[(conv.in_channels, conv.out_channels, conv.kernel_size[0], conv.stride[0],
                  conv.padding[0], x.shape[-1], prologue)] += 1  # fmt: skip

        return record

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook(name))
    with torch.no_grad():
        model(torch.zeros(1, 3, size, size))
    return seen


def ms(fn, reps: int = 20, blocks: int = 5) -> float:
    """Device time of one call: ``reps`` calls captured in a CUDA graph (as the trainer's step
    runs them: no host launch cost), the median over ``blocks`` replays."""
    fn()  # plans, cuDNN autotuning
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    out = []
    for _ in range(blocks):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def parse_args(doc: str) -> argparse.Namespace:
    """The model and batch a layer-by-layer tool measures (this one and conv_bn_backward.py)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    return p.parse_args()


def main() -> None:
    args = parse_args(__doc__)
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    rows, totals = [], Counter()
    print(
        "| c → k | kernel, stride | input | prologue | count | bare conv ms | unfused ms "
        "| cuDNN fused ms | fused vs unfused |\n|---|---|---|---|---:|---:|---:|---:|---:|"
    )
    for (c, k, r, stride, pad, size, prologue), count in layers(args.arch, args.image_size).items():
        x = torch.randn(args.batch, c, size, size, device=dev).half()
        x = x.contiguous(memory_format=torch.channels_last)
        w = (torch.randn(k, c, r, r, device=dev) * 0.05).half()
        w = w.contiguous(memory_format=torch.channels_last)
        scale = torch.rand(c, device=dev) + 0.5 if prologue else None
        bias = torch.randn(c, device=dev) * 0.1 if prologue else None
        bare = ms(lambda x=x, w=w, s=stride, p=pad: F.conv2d(x, w, stride=s, padding=p))
        unfused = ms(lambda x=x, w=w, a=scale, b=bias, s=stride, p=pad: reference(x, w, a, b, s, p))
        fused = None
        if cudnn_conv_bn.forward(x, w, scale, bias, stride, pad) is not None:
            fused = ms(lambda x=x, w=w, a=scale, b=bias, s=stride, p=pad: cudnn_conv_bn.forward(
                x, w, a, b, s, p))  # fmt: skip
        totals["bare"] += count * bare
        totals["unfused"] += count * unfused
        totals["best"] += count * min(unfused, fused or unfused)
        rows.append(fused)
        fused_text = f"{fused:.3f}" if fused is not None else "declined"
        gain = f"{100 * (fused / unfused - 1):+.0f}%" if fused is not None else ""
        kind = f"| {c} → {k} | {r}×{r}, {stride} | {size}² | {'yes' if prologue else 'no'} "
        print(f"{kind}| {count} | {bare:.3f} | {unfused:.3f} | {fused_text} | {gain} |", flush=True)
    ran = sum(f is not None for f in rows)
    where = f"cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}"
    print(
        f"\nforward totals over every convolution of {args.arch} at batch {args.batch}: bare "
        f"{totals['bare']:.2f} ms, unfused {totals['unfused']:.2f} ms, the faster of "
        f"fused/unfused per layer {totals['best']:.2f} ms; cuDNN ran {ran} of {len(rows)} "
        f"kinds ({where})"
    )


if __name__ == "__main__":
    main()
