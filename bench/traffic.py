"""How many bytes the compiled train step's generated kernels move, by model path, from
inductor's own estimate: which BatchNorm passes a fusion removed, and which kernels move the
most. ``kernel_split.py`` says where a step's GPU *time* goes; this says where its *memory
traffic* goes, without a GPU.

Usage: python bench/traffic.py [--arch resnet50] [--paths plain,fused,fold] [--size 64]
                                [--top 8] [--backend triton|cpp]

Each path's forward and backward (cross-entropy loss, no optimizer) is compiled by inductor for
``--device`` (the CPU by default), in fp32, and every kernel inductor generates (its Triton or
C++ kernels, not the convolutions and matmuls it calls) is counted with inductor's estimate of
the bytes it reads and writes (each buffer once per kernel, the best case:
``get_read_write_buffers_sizes``, which ``GraphLowering.count_bytes`` sums). Totals are in
**passes**: one pass reads or writes every BatchNorm output of the model once. The image size
and batch change the bytes, not the passes (up to rounding at small sizes); in fp16 or bf16
every activation's bytes halve, so the passes stay. Kernels that iterate over no more elements
than the model's widest BN has channels (per-channel and one-element kernels) are counted apart
as *small*: in a step they cost a launch and a few microseconds each, not bandwidth. Paths:

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
  mask kept as bits for its backward (``pack_block_mask``, ``signs.relu_and_signs``) and every
  BN's batch counted at once (``count_once``), the stem unpadded (below).

Every fused path leaves the stem's image unpadded (``pad_stem=False``; ``--fused-bn`` pads it to
4 channels): the padding is one more pass over the image in inductor's kernels, made for a faster
cuDNN convolution, which this count does not see; with it the count would compare the stem's
layout, not the BN passes.

On the CPU, the kernels are those inductor's **Triton backend** makes (``--backend triton``, the
default): a GPU's. Inductor schedules the CPU's graphs as it would a GPU's
(``cpu_backend="triton"``: its fusion decisions, store-or-recompute thresholds and grouping of
``_foreach`` ops), and each graph's kernels are read as code generation begins, where the compile
stops: Triton compiles nothing for a CPU. The forward is scheduled so, then compiled by the C++
backend to run, and its backward scheduled so. ``--backend cpp`` counts the C++ backend's own
kernels, compiled and run: it fuses differently (loops of different sizes in one kernel, the
block end's bits in loops of their own, no grouping of ``_foreach`` ops), with ``--gpu-thresholds``
for the Triton backend's thresholds.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

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
    small: int = 0  # per-channel and one-element kernels: a launch each, not bandwidth


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
        count_once=path == "fused",
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


def measure(
    arch: str,
    path: str,
    size: int,
    batch: int,
    device: str,
    top: int = 8,
    backend: str = "triton",
) -> Traffic:
    """Compile ``path``'s forward + backward at ``size`` px and count its kernels' bytes; on
    the CPU, with ``backend`` "triton", the kernels inductor's Triton backend schedules."""
    torch._dynamo.reset()
    dev = torch.device(device)
    x = torch.randn(batch, 3, size, size, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)
    one_pass = bn_elements(arch, x.cpu()) * x.element_size()
    model = build(arch, path).to(dev, memory_format=torch.channels_last).train()
    if dev.type == "cpu" and backend == "triton":
        kernels = triton_kernels(model, x, y)
    else:
        kernels = compiled_kernels(model, x, y)
    heavy = [(k.bytes / one_pass, k.ops) for k in kernels]
    total = sum(passes for passes, _ in heavy)
    heavy.sort(key=lambda item: -item[0])
    widest = max(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    small = sum(1 for k in kernels if k.elements <= widest)
    return Traffic(path, len(heavy), total, heavy[:top], small)


@dataclass(frozen=True)
class Kernel:
    """One of inductor's kernels: the bytes it moves, the ops it fuses, the elements it
    iterates over (its largest part's, reduced ones included)."""

    bytes: int
    ops: str
    elements: int

    @classmethod
    def of(cls, node, num_bytes: int) -> Kernel:
        elements = 0
        for sub in node.get_nodes():
            # (elements, reduced) for the Triton backend; each a tuple of sizes for the C++ one
            sizes = _flat(sub.group[1])
            if all(getattr(size, "is_number", False) for size in sizes):
                elements = max(elements, math.prod(int(size) for size in sizes))
        return cls(num_bytes, _origins(node), elements)


def _flat(sizes) -> list:
    """``sizes``, nested tuples of sizes, as one list."""
    if isinstance(sizes, tuple):
        return [size for part in sizes for size in _flat(part)]
    return [sizes]


def _step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> None:
    F.cross_entropy(model(images), labels).backward()


def compiled_kernels(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[Kernel]:
    """Each kernel of ``model``'s compiled forward + backward, compiled and run on ``x``'s
    device by the backend inductor takes there."""
    from torch._inductor import metrics

    metrics.reset()
    with counting():
        torch.compile(_step)(model, x, y)
    # count_bytes records bytes // 4
    return [Kernel.of(node, 4 * quarter) for node, quarter in metrics.nodes_num_elem if _own(node)]


class Scheduled(Exception):
    """Inductor's scheduler has fused a graph's kernels, which were read: no code follows."""


def triton_kernels(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[Kernel]:
    """Each kernel of ``model``'s forward + backward as inductor's Triton backend schedules
    them, on the CPU (module notes): the forward scheduled, then compiled by the C++ backend to
    run, then its backward scheduled."""
    fw: list[Kernel] = []
    bw: list[Kernel] = []

    def loss(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(images), labels)

    with counting(), scheduling(fw):
        _until_scheduled(lambda: torch.compile(loss)(x, y), fw)
    torch._dynamo.reset()
    with counting():
        out = torch.compile(loss)(x, y)
        with scheduling(bw):
            _until_scheduled(out.backward, bw)
    return fw + bw


def _until_scheduled(run, kernels: list) -> None:
    """``run()``, which stops where its graph's kernels are read (``Scheduled``, wrapped in
    whatever dynamo or inductor raise around it); any other failure is raised."""
    try:
        run()
    except Exception:
        if not kernels:
            raise
        return
    raise RuntimeError("traffic: the compile ended without scheduling a graph")


@contextlib.contextmanager
def scheduling(kernels: list[Kernel]) -> Iterator[None]:
    """Inductor schedules the CPU's graphs as its Triton backend does (``cpu_backend``, and
    the Triton backend's store-or-recompute thresholds), and the first graph's kernels, with
    their bytes, go into ``kernels`` as its code generation begins, which stops there."""
    import torch._inductor.config as inductor
    from torch._inductor.scheduler import Scheduler

    def read(scheduler: Scheduler) -> None:
        if not kernels:
            kernels.extend(
                Kernel.of(node, node.get_read_write_buffers_sizes())
                for node in scheduler.nodes
                if _own(node)
            )
        raise Scheduled

    with (
        inductor.patch(cpu_backend="triton", **gpu_thresholds()),
        mock.patch.object(Scheduler, "codegen", read),
    ):
        yield


def gpu_thresholds() -> dict[str, int]:
    """Inductor's store-or-recompute thresholds as its Triton backend sets them (its C++ backend
    sets others), by config name."""
    import torch._inductor.config as inductor

    return {
        "realize_opcount_threshold": inductor._realize_opcount_threshold_default,
        "realize_acc_reads_threshold": inductor._realize_acc_reads_threshold_default,
    }


def _own(node) -> bool:
    """Whether a scheduler node is a kernel of inductor's own: not nothing, nor a convolution
    or matmul it calls."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    return not isinstance(node, (NopKernelSchedulerNode, ExternKernelSchedulerNode))


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
        "--backend",
        choices=("triton", "cpp"),
        default="triton",
        help="on the CPU, count the kernels inductor's Triton backend (a GPU's) schedules, or "
        "those its C++ backend compiles",
    )
    p.add_argument(
        "--gpu-thresholds",
        action="store_true",
        help="with --backend cpp, the Triton backend's store-or-recompute thresholds",
    )
    args = p.parse_args()
    paths = args.paths.split(",")
    if bad := [q for q in paths if q not in PATHS]:
        p.error(f"--paths: unknown {', '.join(bad)}; choose from {', '.join(PATHS)}")
    if args.backend == "cpp" and args.device != "cpu":
        p.error("--backend cpp: only with --device cpu (elsewhere inductor's own backend counts)")
    import torch._inductor.config as inductor

    if args.gpu_thresholds:
        for name, value in gpu_thresholds().items():
            setattr(inductor, name, value)
    results = [
        measure(args.arch, q, args.size, args.batch, args.device, args.top, args.backend)
        for q in paths
    ]
    where = args.device if args.device != "cpu" else f"cpu, {args.backend} backend"
    print(f"{args.arch}, {args.size} px, batch {args.batch}, {where}: passes over every "
          "BatchNorm output (inductor's byte estimate)\n")  # fmt: skip
    print("| path | inductor's kernels | of them per-channel or one-element | traffic (passes) |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r.path} | {r.kernels} | {r.small} | {r.kernel_passes:.2f} |")
    for r in results:
        print(f"\n{r.path}: heaviest kernels (passes: the ops they fuse)")
        for passes, ops in r.top:
            print(f"  {passes:6.3f}  {ops}")


if __name__ == "__main__":
    main()
