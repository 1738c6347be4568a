"""conv_bn's backward, layer by layer: for each kind of convolution in a ResNet, the bare dgrad
and wgrad, the BN work the fused path's backward adds around a convolution with a prologue, done
by inductor (the prologue recomputed for wgrad; the ReLU mask and BatchNorm's two per-channel
sums on dgrad's output), and the same work as cuDNN's fused backward graphs (wgrad with the
prologue, "dgrad + dReLU + sums"), in fp16 channels_last, timed as device time from CUDA graph
replays (as ``bench/conv_bn_layers.py`` times the forward). The BN backward's last pass (the
input gradient from the sums) is the same either way and is not timed. Prints a markdown table
and the totals, weighted by how often the model runs each convolution: what a backward that
picks the faster of the two for each half would cost.

Usage: python bench/conv_bn_backward.py [--arch resnet50] [--batch 256] [--image-size 224]
Needs a GPU and ``pip install --no-deps nvidia-cudnn-frontend``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from conv_bn_layers import layers, ms, parse_args  # bench/conv_bn_layers.py, beside this file
from torch import Tensor

from fasttrain.model.cudnn.graph import select_fastest

HEURISTICS = ("A", "B", "FALLBACK")


def bare(dy: Tensor, a: Tensor, w: Tensor, stride: int, pad: int, mask: list[bool]):
    """torch's convolution backward: dgrad (mask [True, False, False]) or wgrad."""
    return torch.ops.aten.convolution_backward(
        dy, a, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1, mask
    )


@torch.compile(dynamic=False)
def prologue(x: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """The wgrad input the fused forward never wrote: relu(scale * x + bias)."""
    return torch.relu(x * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)).to(x.dtype)


@torch.compile(dynamic=False)
def drelu_sums(g: Tensor, x: Tensor, scale: Tensor, bias: Tensor):
    """BatchNorm's backward sums over dgrad's output through the ReLU mask. The masked gradient
    is not written: the BN backward's last pass recomputes the mask as it reads dgrad's output
    (cuDNN's fused graph writes it instead; that pass then reads it: the same traffic)."""
    pre = x * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)
    gm = torch.where(pre > 0, g, torch.zeros_like(g)).float()
    return gm.sum((0, 2, 3)), (gm * x.float()).sum((0, 2, 3))


class Graph:
    """One cuDNN frontend graph, built once, bound to fixed tensors; ``None`` if declined."""

    def __init__(self, build: Callable, handle):
        import cudnn

        half, f32 = cudnn.data_type.HALF, cudnn.data_type.FLOAT
        self.handle = handle
        self.g = cudnn.pygraph(
            io_data_type=half, intermediate_data_type=f32, compute_data_type=f32, handle=handle
        )
        self.pack = build(self.g)
        self.g.validate()
        self.g.build_operation_graph()
        self.g.create_execution_plans([getattr(cudnn.heur_mode, h) for h in HEURISTICS])
        self.g.check_support()
        # the fastest of every plan cuDNN ranks, timed here, as the trainer's fused forward does
        select_fastest(self.g, self.run)
        self.workspace = self.allocate(self.g.get_workspace_size())

    @staticmethod
    def allocate(size: int) -> Tensor:
        return torch.empty(max(1, size), device="cuda", dtype=torch.uint8)

    def run(self, workspace: int) -> None:
        self.workspace = self.allocate(workspace)
        self()

    def __call__(self) -> None:
        import cudnn

        # on the stream the caller is on: a side stream, or the one a CUDA graph captures
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.g.execute(self.pack, self.workspace, handle=self.handle)


def tensor(g, t: Tensor, name: str):
    import cudnn

    kind = {torch.float16: cudnn.data_type.HALF, torch.float32: cudnn.data_type.FLOAT}[t.dtype]
    return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=kind)


def vector(t: Tensor) -> Tensor:
    """A per-channel vector as cuDNN's graphs take it: (1, C, 1, 1), fp16 (its fused kernels
    found no engine for fp32 vectors on cuDNN 9.19)."""
    return t.half().view(1, -1, 1, 1).contiguous(memory_format=torch.channels_last)


def fused_wgrad(x, dy, w, scale, bias, stride, pad, handle) -> Graph:
    """wgrad with the scale + bias + ReLU prologue applied to x as cuDNN reads it."""
    import cudnn

    dw = torch.empty_like(w)
    s, b = vector(scale), vector(bias)

    def build(g):
        tx, tdy, ts, tb = (
            tensor(g, x, "x"),
            tensor(g, dy, "dy"),
            tensor(g, s, "s"),
            tensor(g, b, "b"),
        )
        image = g.relu(input=g.bias(input=g.scale(input=tx, scale=ts), bias=tb))
        out = g.conv_wgrad(image=image, loss=tdy, padding=[pad] * 2, stride=[stride] * 2,
                           dilation=[1, 1])  # fmt: skip
        out.set_output(True).set_data_type(cudnn.data_type.HALF)
        out.set_dim(list(w.shape)).set_stride(list(w.stride()))
        return {tx: x, tdy: dy, ts: s, tb: b, out: dw}

    return Graph(build, handle)


def fused_dgrad(x_prev, dy, w, scale, bias, stride, pad, handle) -> Graph:
    """dgrad, the ReLU mask of the prologue's pre-activation (scale * x_prev + bias) and
    BatchNorm's two sums over the result (of it, and of it times x_prev)."""
    import cudnn

    f32, half = cudnn.data_type.FLOAT, cudnn.data_type.HALF
    c = x_prev.shape[1]
    gm = torch.empty_like(x_prev)
    s1 = torch.empty(1, c, 1, 1, device="cuda").contiguous(memory_format=torch.channels_last)
    s2 = torch.empty_like(s1)
    s, b = vector(scale), vector(bias)

    def build(g):
        tdy, tw, tx = tensor(g, dy, "dy"), tensor(g, w, "w"), tensor(g, x_prev, "x")
        ts, tb = tensor(g, s, "s"), tensor(g, b, "b")
        dx = g.conv_dgrad(loss=tdy, filter=tw, padding=[pad] * 2, stride=[stride] * 2,
                          dilation=[1, 1])  # fmt: skip
        dx.set_dim(list(x_prev.shape)).set_stride(list(x_prev.stride()))
        pre = g.bias(input=g.scale(input=tx, scale=ts), bias=tb)
        out = g.relu_backward(loss=dx, input=pre)
        out.set_output(True).set_data_type(half)
        total = g.reduction(input=out, mode=cudnn.reduction_mode.ADD)
        total.set_output(True).set_data_type(f32).set_dim([1, c, 1, 1]).set_stride([c, 1, c, c])
        dot = g.reduction(input=g.mul(a=out, b=tx), mode=cudnn.reduction_mode.ADD)
        dot.set_output(True).set_data_type(f32).set_dim([1, c, 1, 1]).set_stride([c, 1, c, c])
        return {tdy: dy, tw: w, tx: x_prev, ts: s, tb: b, out: gm, total: s1, dot: s2}

    return Graph(build, handle)


def try_graph(make: Callable[[], Graph]) -> tuple[float | None, str]:
    """Its device time, or None and why cuDNN declined it."""
    try:
        return ms(make()), ""
    except Exception as e:  # the frontend raises its own types; any means "not this one"
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def shown(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "declined"


def measure(c, k, r, stride, pad, size, pro, batch, handle) -> tuple[str, float, float, list]:
    """One kind of convolution: its table row, the unfused backward's time, the time of the
    faster of fused and unfused for each half (wgrad side, dgrad side), and what cuDNN
    declined."""
    cl = torch.channels_last
    out = (size + 2 * pad - r) // stride + 1
    x = torch.randn(batch, c, size, size, device="cuda").half().contiguous(memory_format=cl)
    dy = torch.randn(batch, k, out, out, device="cuda").half().contiguous(memory_format=cl)
    w = (torch.randn(k, c, r, r, device="cuda") * 0.05).half().contiguous(memory_format=cl)
    scale = torch.rand(c, device="cuda") + 0.5
    bias = torch.randn(c, device="cuda") * 0.1
    a = prologue(x, scale, bias) if pro else x  # the conv's input as the unfused path has it
    # the stem reads the image, which needs no gradient: training runs no dgrad there
    image = c == 3
    dgrad = 0.0 if image else ms(lambda: bare(dy, a, w, stride, pad, [True, False, False]))
    wgrad = ms(lambda: bare(dy, a, w, stride, pad, [False, True, False]))
    row = f"| {c} → {k} | {r}×{r}, {stride} | {size}² | {'yes' if pro else 'no'} "
    row += f"| {'not run' if image else f'{dgrad:.3f}'} | {wgrad:.3f} "
    if not pro:
        return row + "| | | | ", dgrad + wgrad, dgrad + wgrad, []
    g = torch.randn_like(x)  # dgrad's output, the gradient of the prologue's output
    recompute = ms(lambda: prologue(x, scale, bias))
    mask_sums = ms(lambda: drelu_sums(g, x, scale, bias))
    fw, why_w = try_graph(lambda: fused_wgrad(x, dy, w, scale, bias, stride, pad, handle))
    fd, why_d = try_graph(lambda: fused_dgrad(x, dy, w, scale, bias, stride, pad, handle))
    declined = [f"{c}→{k} {r}×{r}/{stride} {what}: {why}"
                for what, why in (("wgrad", why_w), ("dgrad", why_d)) if why]  # fmt: skip
    unfused = dgrad + wgrad + recompute + mask_sums
    best = min(wgrad + recompute, fw or float("inf")) + min(dgrad + mask_sums, fd or float("inf"))
    row += f"| {recompute:.3f} | {mask_sums:.3f} | {shown(fw)} | {shown(fd)} "
    return row, unfused, best, declined


def main() -> None:
    import cudnn

    args = parse_args(__doc__)
    torch.backends.cudnn.benchmark = True
    # the two compiled helpers specialise on each layer's shapes: one compile per kind, none
    # falling back to eager
    torch._dynamo.config.recompile_limit = 256
    handle = cudnn.create_handle()
    totals: Counter = Counter()
    declined: list[str] = []
    print(
        "| c → k | kernel, stride | input | prologue | dgrad | wgrad | inductor: prologue "
        "| inductor: dReLU + sums | cuDNN: wgrad + prologue | cuDNN: dgrad + dReLU + sums "
        "| count | unfused | faster per half |\n"
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for (c, k, r, stride, pad, size, pro), count in layers(args.arch, args.image_size).items():
        row, unfused, best, why = measure(c, k, r, stride, pad, size, pro, args.batch, handle)
        totals["unfused"] += count * unfused
        totals["best"] += count * best
        declined += why
        print(row + f"| {count} | {unfused:.3f} | {best:.3f} |", flush=True)
    for line in declined:
        print(f"- declined: {line}")
    where = f"cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}"
    print(
        f"\nbackward totals over every convolution of {args.arch} at batch {args.batch} (ms): "
        f"bare convs + inductor's BN work {totals['unfused']:.2f}, the faster of that and "
        f"cuDNN's fused graphs for each half {totals['best']:.2f} ({where})"
    )


if __name__ == "__main__":
    main()
