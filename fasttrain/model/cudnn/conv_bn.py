"""cuDNN's fused convolution forward for ``conv_bn``: the scale-bias-ReLU prologue, the
convolution and the per-channel statistics in one graph (cuDNN's "ConvBNfprop"), through the
cuDNN frontend's Python graph API (``pip install nvidia-cudnn-frontend``).

cuDNN runs this fusion in fp16 only, NHWC, and takes the prologue's scale and bias in fp16 (on
cuDNN 9.19 the fp32 vectors find no engine); anything else (bf16, fp32, a shape or build that
cuDNN declines, such as the stem's 3 input channels) is answered with None and ``conv_bn`` runs
its reference. Its output is the reference's on the fp16-rounded vectors (GPU tests).

A graph and its plan are built once per shape and kept; each call only binds the tensors and
launches on the current stream, so the call is capturable in a CUDA graph (its workspace comes
from torch's allocator).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fasttrain.model.cudnn.graph import available, execute, handle, select_fastest

log = logging.getLogger("fasttrain")


@dataclass
class _Plan:
    graph: Any
    tensors: dict[str, Any]  # the graph's tensors by name, to bind at each call
    workspace: int
    vector_dtype: torch.dtype  # what scale and bias are bound as (the variant cuDNN took)


_plans: dict[tuple, _Plan | None] = {}  # None: cuDNN declined that shape
# How the prologue's per-channel scale and bias may be described, tried in this order: fp32 (what
# the reference computes with), or the io type, each with a channels-last or a packed stride
_VECTOR_VARIANTS = ((torch.float32, "nhwc"), (torch.float32, "nchw"),
                    (torch.float16, "nchw"), (torch.float16, "nhwc"))  # fmt: skip


def _build(x: Tensor, w: Tensor, prologue: bool, stride: int, padding: int) -> _Plan | None:
    """The first variant cuDNN supports (``_VECTOR_VARIANTS``; one without a prologue), with
    its fastest plan; None (and a warning naming the shape, once) where cuDNN takes none."""
    for dtype, layout in _variants(prologue):
        try:
            return _build_variant(x, w, prologue, stride, padding, dtype, layout)
        except Exception as e:  # cudnn raises its own types; any of them means "not this one"
            log.debug(
                "cuDNN declined conv_bn for x %s, w %s, vectors %s %s: %s",
                tuple(x.shape), tuple(w.shape), dtype, layout, str(e)[:200],
            )  # fmt: skip
    log.warning(
        "cuDNN takes no fused convolution + statistics for x %s, w %s, stride %d: that layer "
        "runs the plain-PyTorch reference (slower)",
        "x".join(map(str, x.shape)),
        "x".join(map(str, w.shape)),
        stride,
    )
    return None


def _variants(prologue: bool) -> tuple[tuple[torch.dtype, str], ...]:
    return _VECTOR_VARIANTS if prologue else ((torch.float32, "nhwc"),)


def supported(
    x_shape: tuple[int, ...],
    w_shape: tuple[int, ...],
    stride: int,
    padding: int,
    prologue: bool,
    device: torch.device,
) -> bool:
    """Whether cuDNN has an engine for ``conv_bn`` at these shapes (fp16, channels_last) on
    ``device``: its graph validates and its heuristics' plans pass ``check_support``. Nothing
    is built or timed, so it is cheap enough to ask for every layer at start-up."""
    for dtype, layout in _variants(prologue):
        try:
            _graph(x_shape, _nhwc_strides(x_shape), w_shape, _nhwc_strides(w_shape), device,
                   prologue, stride, padding, dtype, layout)  # fmt: skip
            return True
        except Exception:  # cudnn raises its own types; any of them means "not this one"
            continue
    return False


def _nhwc_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a channels_last tensor of NCHW ``shape``."""
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _build_variant(
    x: Tensor, w: Tensor, prologue: bool, stride: int, padding: int, dtype, layout: str
) -> _Plan:
    g, tensors = _graph(tuple(x.shape), x.stride(), tuple(w.shape), w.stride(), x.device,
                        prologue, stride, padding, dtype, layout)  # fmt: skip
    plan = _Plan(g, tensors, 0, dtype)
    _select_fastest(plan, x, w, prologue, stride, padding, layout)
    plan.workspace = g.get_workspace_size()
    return plan


def _graph(
    x_shape: tuple[int, ...],
    x_stride: tuple[int, ...],
    w_shape: tuple[int, ...],
    w_stride: tuple[int, ...],
    device: torch.device,
    prologue: bool,
    stride: int,
    padding: int,
    dtype: torch.dtype,
    layout: str,
) -> tuple[Any, dict[str, Any]]:
    """The conv + statistics graph (with the prologue where asked), validated, with the
    heuristics' plans checked; raises where cuDNN has no engine for it."""
    import cudnn

    f32, half = cudnn.data_type.FLOAT, cudnn.data_type.HALF
    g = cudnn.pygraph(
        io_data_type=half,
        intermediate_data_type=f32,
        compute_data_type=f32,
        handle=handle(device),
    )
    c = x_shape[1]
    vec = {
        "dim": [1, c, 1, 1],
        "stride": [c, 1, c, c] if layout == "nhwc" else [c, 1, 1, 1],
        "data_type": f32 if dtype == torch.float32 else half,
    }
    tensors = {
        "x": g.tensor(name="x", dim=list(x_shape), stride=list(x_stride), data_type=half),
        "w": g.tensor(name="w", dim=list(w_shape), stride=list(w_stride), data_type=half),
    }
    image = tensors["x"]
    if prologue:
        tensors["scale"] = g.tensor(name="scale", **vec)
        tensors["bias"] = g.tensor(name="bias", **vec)
        image = g.relu(
            input=g.bias(input=g.scale(input=image, scale=tensors["scale"]), bias=tensors["bias"])
        )
    y = g.conv_fprop(
        image=image,
        weight=tensors["w"],
        padding=[padding, padding],
        stride=[stride, stride],
        dilation=[1, 1],
    )
    y.set_output(True).set_data_type(half)
    total, total_sq = g.genstats(input=y)
    total.set_output(True).set_data_type(f32)
    total_sq.set_output(True).set_data_type(f32)
    tensors.update(y=y, sum=total, sumsq=total_sq)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g, tensors


def _select_fastest(
    plan: _Plan, x: Tensor, w: Tensor, prologue: bool, stride: int, padding: int, layout: str
) -> None:
    """``select_fastest`` for a conv_bn graph, run on the call's own shapes, its choice kept
    under the graph's description."""
    c = x.shape[1]
    vectors = (torch.rand(c, device=x.device) + 0.5, torch.rand(c, device=x.device))
    vec = vectors if prologue else (None, None)

    def run(workspace: int) -> None:
        plan.workspace = workspace
        _execute(plan, x, w, *vec, stride, padding)

    key = ("conv_bn", x.shape, x.stride(), w.shape, w.stride(), prologue, stride, padding,
           plan.vector_dtype, layout)  # fmt: skip
    select_fastest(plan.graph, run, key=key, device=x.device)


def forward(
    x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, stride: int, padding: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``conv_bn``'s (y, sum, sum of squares) by cuDNN, or None where it does not run (module
    notes)."""
    if x.dtype != torch.float16 or not x.is_cuda or not available():
        return None
    if not x.is_contiguous(memory_format=torch.channels_last):
        return None
    w = weight.to(torch.float16).contiguous(memory_format=torch.channels_last)
    prologue = scale is not None
    key = (x.device, tuple(x.shape), tuple(w.shape), stride, padding, prologue)
    if key not in _plans:
        _plans[key] = _build(x, w, prologue, stride, padding)
    plan = _plans[key]
    if plan is None:
        return None
    return _execute(plan, x, w, scale, bias, stride, padding)


def _execute(
    plan: _Plan, x: Tensor, w: Tensor, scale, bias, stride: int, padding: int
) -> tuple[Tensor, Tensor, Tensor]:

    n, _, h, wd = x.shape
    k, _, r, s = w.shape
    ho, wo = (h + 2 * padding - r) // stride + 1, (wd + 2 * padding - s) // stride + 1
    y = torch.empty(
        (n, k, ho, wo), dtype=torch.float16, device=x.device, memory_format=torch.channels_last
    )
    total = torch.empty(k, dtype=torch.float32, device=x.device)
    total_sq = torch.empty(k, dtype=torch.float32, device=x.device)
    t = plan.tensors
    binds = {t["x"]: x, t["w"]: w, t["y"]: y, t["sum"]: total, t["sumsq"]: total_sq}
    if scale is not None:
        binds[t["scale"]] = scale.to(plan.vector_dtype).contiguous()
        binds[t["bias"]] = bias.to(plan.vector_dtype).contiguous()
    execute(plan.graph, binds, plan.workspace, x.device)
    return y, total, total_sq
