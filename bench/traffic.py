"""How many bytes the compiled train step's generated kernels move, by model path, from
inductor's own estimate: which BatchNorm passes a fusion removed, and which kernels move the
most. ``kernel_split.py`` says where a step's GPU *time* goes; this says where its *memory
traffic* goes, without a GPU.

Usage: python bench/traffic.py [--arch resnet50] [--paths plain,fused,fold] [--size 64]
                                [--top 8]

Each path's forward and backward (cross-entropy loss, no optimizer) is compiled by inductor for
``--device`` (the CPU by default), in fp32, and every kernel inductor generates (its Triton or
C++ kernels, not the convolutions and matmuls it calls) is counted with inductor's estimate of
the bytes it reads and writes (``GraphLowering.count_bytes``: each buffer once per kernel, the
best case). Totals are in **passes**: one pass reads or writes every BatchNorm output of the
model once. The image size and batch change the bytes, not the passes (up to rounding at small
sizes); in fp16 or bf16 every activation's bytes halve, so the passes stay. Paths:

- ``plain``: torchvision's ResNet (BatchNorm2d, ReLU), as ``--arch`` builds it;
- ``fused-relu``: ``FusedResNet(mask_from_input=False, store_block_grad=False,
  fuse_stem=False)``: each BN's statistics summed by the convolution before it, its normalise +
  ReLU one elementwise pass with torch.relu's gradient (masked by the pass's output), the block
  ends and the stem as torch computes them;
- ``mask``: ``fused-relu`` with each pass's ReLU gradient masked by the pass's input
  (``conv_bn.affine_relu``);
- ``fold``: ``mask`` with ``fold=ALL``: the normalise + ReLU applied as the next
  convolution reads its input (the backward then recomputes it for the weight gradient);
- ``stored``: ``mask`` with each block end's masked gradient stored once for its readers
  (``store_block_grad``, ``conv_bn.residual_relu``);
- ``stem``: ``mask`` with the stem's BN run as the others (``fuse_stem``: statistics by one
  reduction, normalise + ReLU masked by its input);
- ``unpacked``: ``mask`` with both;
- ``fused``: ``FusedResNet`` as ``--fused-bn`` builds it: ``unpacked`` with each block end's ReLU
  mask kept as bits for its backward (``pack_block_mask``, ``signs.relu_and_signs``), the stem
  unpadded (below). The C++ backend writes the bits in loops of their own, which the Triton
  backend fuses with the block's output: on the CPU this path counts more than on a GPU.

Every fused path leaves the stem's image unpadded (``pad_stem=False``; ``--fused-bn`` pads it to
4 channels): the padding is one more pass over the image in inductor's kernels, made for a faster
cuDNN convolution, which this count does not see; with it the count would compare the stem's
layout, not the BN passes.

On the CPU, inductor's C++ backend makes the fusion decisions of the Triton backend except for
a few thresholds (when a reused expression is stored rather than recomputed);
``--gpu-thresholds`` applies the Triton backend's.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

PATHS = ("plain", "fused-relu", "mask", "fold", "stored", "stem", "unpacked", "fused")


@dataclass
class Traffic:
    """One path's estimated traffic: totals in passes, and the heaviest kernels."""

    path: str
    kernels: int
    kernel_passes: float
    top: list[tuple[float, str]]


def build(arch: str, path: str) -> nn.Module:
    """The model of ``path`` (one of ``PATHS``), same weights for the same seed."""
    from fasttrain.model.fused_resnet import ALL, FusedResNet

    torch.manual_seed(0)
    if path == "plain":
        return getattr(torchvision.models, arch)()
    return FusedResNet(
        arch,
        fold=ALL if path == "fold" else (),
        mask_from_input=path != "fused-relu",
        store_block_grad=path in ("stored", "unpacked", "fused"),
        fuse_stem=path in ("stem", "unpacked", "fused"),
        pack_block_mask=path == "fused",
        pad_stem=False,  # module notes
    )


def bn_elements(arch: str, x: torch.Tensor) -> int:
    """The elements of every BatchNorm output of ``arch`` for ``x``: one pass."""
    model = build(arch, "plain").to(memory_format=torch.channels_last)
    sizes: list[int] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel()))
        for m in model.modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return sum(sizes)


def measure(arch: str, path: str, size: int, batch: int, device: str, top: int = 8) -> Traffic:
    """Compile ``path``'s forward + backward at ``size`` px and count its kernels' bytes."""
    from torch._inductor import metrics
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    torch._dynamo.reset()
    dev = torch.device(device)
    x = torch.randn(batch, 3, size, size, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)
    one_pass = bn_elements(arch, x.cpu()) * x.element_size()
    model = build(arch, path).to(dev, memory_format=torch.channels_last).train()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        F.cross_entropy(model(images), labels).backward()

    metrics.reset()
    with counting():
        torch.compile(step)(x, y)
    heavy: list[tuple[float, str]] = []
    for node, quarter_bytes in metrics.nodes_num_elem:  # count_bytes records bytes // 4
        if isinstance(node, (NopKernelSchedulerNode, ExternKernelSchedulerNode)):
            continue  # nothing, or a convolution or matmul inductor calls: not its own kernel
        heavy.append((4 * quarter_bytes / one_pass, _origins(node)))
    total = sum(passes for passes, _ in heavy)
    heavy.sort(key=lambda item: -item[0])
    return Traffic(path, len(heavy), total, heavy[:top])


@contextlib.contextmanager
def counting() -> Iterator[None]:
    """Inductor counts each kernel's bytes (``metrics.nodes_num_elem``) while its
    ``inductor_metrics`` log is on (INFO); its records, a wall of node reprs, go nowhere. No
    cache may answer, since a hit compiles nothing."""
    import torch._inductor.config as inductor

    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")
    saved = log.level, log.propagate, log.handlers
    log.setLevel(logging.INFO)
    log.propagate, log.handlers = False, [logging.NullHandler()]
    try:
        with (
            inductor.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            yield
    finally:
        log.setLevel(saved[0])
        log.propagate, log.handlers = saved[1], saved[2]


def _origins(node) -> str:
    """The aten ops a fused kernel was made from, short: what the kernel does."""
    names = {
        str(origin.target).removeprefix("aten.").split(".")[0]
        for sub in node.get_nodes()
        for origin in getattr(sub.node, "origins", ())
    }
    return ", ".join(sorted(names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated: " + ", ".join(PATHS))
    p.add_argument("--size", type=int, default=64, help="image size (px)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--top", type=int, default=8, help="heaviest kernels to list per path")
    p.add_argument(
        "--gpu-thresholds",
        action="store_true",
        help="on the CPU, the Triton backend's store-or-recompute thresholds",
    )
    args = p.parse_args()
    paths = args.paths.split(",")
    if bad := [q for q in paths if q not in PATHS]:
        p.error(f"--paths: unknown {', '.join(bad)}; choose from {', '.join(PATHS)}")
    import torch._inductor.config as inductor

    if args.gpu_thresholds:
        inductor.realize_opcount_threshold = inductor._realize_opcount_threshold_default
        inductor.realize_acc_reads_threshold = inductor._realize_acc_reads_threshold_default
    results = [measure(args.arch, q, args.size, args.batch, args.device, args.top) for q in paths]
    print(f"{args.arch}, {args.size} px, batch {args.batch}, {args.device}: passes over every "
          "BatchNorm output (inductor's byte estimate)\n")  # fmt: skip
    print("| path | inductor's kernels | their traffic (passes) |")
    print("|---|---:|---:|")
    for r in results:
        print(f"| {r.path} | {r.kernels} | {r.kernel_passes:.2f} |")
    for r in results:
        print(f"\n{r.path}: heaviest kernels (passes: the ops they fuse)")
        for passes, ops in r.top:
            print(f"  {passes:6.3f}  {ops}")


if __name__ == "__main__":
    main()
