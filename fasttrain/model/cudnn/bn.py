"""cuDNN's standalone fused BatchNorm kernels for ``bn_act``: BN (+ add) (+ ReLU, writing a bit
mask) forward, and dReLU (+ dAdd) + dBN backward, each one cuDNN frontend graph.

They run in bf16 and fp16, NHWC (channels_last), with the BN's weight and bias in fp32 and the
statistics in fp32; anything else (another dtype or layout, a channel count that is not a
multiple of 8 under a ReLU, a graph cuDNN declines) is answered with None and ``bn_act`` runs its
reference. A graph and its fastest plan are built once per shape and kept; each call binds the
tensors and launches on torch's current stream, so it is capturable in a CUDA graph.

The running statistics are not cuDNN's to update: ``batch_norm_act`` folds the batch mean and
variance into them as ``nn.BatchNorm2d`` does. The graph is built without them where cuDNN takes
that, else with scratch running buffers whose results are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fasttrain.model.cudnn.graph import available, execute, handle, select_fastest

log = logging.getLogger("fasttrain")

_IO = (torch.float16, torch.bfloat16)


@dataclass
class _Plan:
    graph: Any
    tensors: dict[str, Any]  # the graph's tensors by name, to bind at each call
    workspace: int = 0
    constants: dict[str, Tensor] = field(default_factory=dict)  # bound at every call as they are


_plans: dict[tuple, _Plan | None] = {}  # None: cuDNN declined that graph
# How many of the plans cuDNN ranks are timed per graph (the rest are never built): each build
# compiles a kernel, and ResNet-50 has about forty BN graphs
PLANS_TIMED = 4


def _io_type(dtype: torch.dtype) -> Any:
    import cudnn

    return cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16


def _fits(*tensors: Tensor) -> bool:
    """The tensors cuDNN's graphs here take: CUDA, bf16 or fp16 alike, channels_last."""
    first = tensors[0]
    return (
        available()
        and first.is_cuda
        and first.dim() == 4
        and first.dtype in _IO
        and all(
            t.dtype == first.dtype and t.is_contiguous(memory_format=torch.channels_last)
            for t in tensors
        )
    )


def _vector(g: Any, name: str, channels: int) -> Any:
    import cudnn

    return g.tensor(
        name=name,
        dim=[1, channels, 1, 1],
        stride=[channels, 1, channels, channels],
        data_type=cudnn.data_type.FLOAT,
    )


def _new_graph(x: Tensor) -> Any:
    import cudnn

    f32 = cudnn.data_type.FLOAT
    return cudnn.pygraph(
        io_data_type=_io_type(x.dtype),
        intermediate_data_type=f32,
        compute_data_type=f32,
        handle=handle(x.device),
    )


def _finish(g: Any) -> None:
    import cudnn

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()


def _cached(key: tuple, build) -> _Plan | None:
    if key not in _plans:
        try:
            _plans[key] = build()
        except Exception as e:  # cudnn raises its own types; any of them means "not this graph"
            log.debug("cuDNN declined BN graph %s: %s", key, str(e)[:200])
            _plans[key] = None
    return _plans[key]


def forward(
    x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor | None, eps: float, relu: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """``bn_act``'s (y, mask, mean, invstd) by cuDNN, or None where it does not run."""
    if residual is not None:
        residual = residual.contiguous(memory_format=torch.channels_last)
    if not _fits(x, *([residual] if residual is not None else [])):
        return None
    c = x.shape[1]
    if relu and c % 8:
        return None
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        return None
    key = ("fwd", x.device, tuple(x.shape), x.dtype, residual is not None, relu, eps)

    def build() -> _Plan:
        for running in (False, True):
            try:
                return _build_forward(x, weight, bias, residual, eps, relu, running)
            except Exception:
                if running:
                    raise
        raise AssertionError("unreachable")

    plan = _cached(key, build)
    return None if plan is None else _run_forward(plan, x, weight, bias, residual, relu)


def _build_forward(x, weight, bias, residual, eps, relu, running: bool) -> _Plan:
    import cudnn

    c = x.shape[1]
    io = _io_type(x.dtype)
    g = _new_graph(x)
    consts = {"eps": torch.full((1, 1, 1, 1), eps, dtype=torch.float64)}
    t = {
        "x": g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=io),
        "scale": _vector(g, "scale", c),
        "bias": _vector(g, "bias", c),
    }
    t["eps"] = g.tensor_like(consts["eps"], name="eps")
    extra = {}
    if running:  # scratch running statistics, where cuDNN wants them (results dropped)
        consts["momentum"] = torch.full((1, 1, 1, 1), 0.1, dtype=torch.float64)
        for name in ("in_mean", "in_var", "out_mean", "out_var"):
            consts[name] = torch.ones(c, dtype=torch.float32, device=x.device)
        t["in_mean"], t["in_var"] = _vector(g, "in_mean", c), _vector(g, "in_var", c)
        t["momentum"] = g.tensor_like(consts["momentum"], name="momentum")
        extra = dict(
            in_running_mean=t["in_mean"], in_running_var=t["in_var"], momentum=t["momentum"]
        )
    outs = g.batchnorm(name="bn", input=t["x"], scale=t["scale"], bias=t["bias"],
                       epsilon=t["eps"], **extra)  # fmt: skip
    y, mean, invstd = outs[0], outs[1], outs[2]
    if running:
        t["out_mean"], t["out_var"] = outs[3], outs[4]
        for out in outs[3:5]:
            out.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    y.set_data_type(io)
    if residual is not None:
        t["z"] = g.tensor(name="z", dim=list(x.shape), stride=list(x.stride()), data_type=io)
        y = g.add(name="add", a=y, b=t["z"])
        y.set_data_type(io)
    if relu:
        y = g.relu(name="relu", input=y)
        y.set_data_type(io)
        consts["zero"] = torch.zeros((1, 1, 1, 1), dtype=x.dtype)
        t["zero"] = g.tensor_like(consts["zero"], name="zero")
        t["mask"] = g.cmp_gt(name="mask", input=y, comparison=t["zero"])
        t["mask"].set_output(True).set_data_type(cudnn.data_type.BOOLEAN)
    y.set_output(True)
    for out in (mean, invstd):
        out.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    t.update(y=y, mean=mean, invstd=invstd)
    _finish(g)
    plan = _Plan(g, t, 0, consts)

    def run(workspace: int) -> None:
        plan.workspace = workspace
        _run_forward(plan, x, weight, bias, residual, relu)

    key = ("bn forward", x.shape, x.stride(), x.dtype, residual is not None, relu, eps, running)
    select_fastest(g, run, limit=PLANS_TIMED, key=key, device=x.device)
    plan.workspace = g.get_workspace_size()
    return plan


def _bind_constants(plan: _Plan) -> dict:
    return {plan.tensors[name]: value for name, value in plan.constants.items()}


def _run_forward(plan: _Plan, x, weight, bias, residual, relu) -> tuple[Tensor, ...]:
    n, c, h, w = x.shape
    t = plan.tensors
    y = torch.empty_like(x, memory_format=torch.channels_last)
    mean = torch.empty(c, dtype=torch.float32, device=x.device)
    invstd = torch.empty(c, dtype=torch.float32, device=x.device)
    binds = {t["x"]: x, t["scale"]: weight, t["bias"]: bias, t["y"]: y, t["mean"]: mean,
             t["invstd"]: invstd, **_bind_constants(plan)}  # fmt: skip
    if residual is not None:
        binds[t["z"]] = residual
    mask = x.new_empty((0,), dtype=torch.uint8)
    if relu:
        mask = torch.empty(
            (n, c // 8, h, w), dtype=torch.uint8, device=x.device, memory_format=torch.channels_last
        )
        binds[t["mask"]] = mask
    execute(plan.graph, binds, plan.workspace, x.device)
    return y, mask, mean, invstd


def backward(
    grad_y: Tensor,
    x: Tensor,
    mask: Tensor,
    weight: Tensor,
    mean: Tensor,
    invstd: Tensor,
    relu: bool,
    residual: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """``bn_act_backward``'s (grad x, grad weight, grad bias, grad residual) by cuDNN, or None
    where it does not run (a residual without a ReLU among them: nothing to fuse there).
    ``grad_y`` is made channels_last where it is not: the gradient that reaches the last BN
    from the average pool's backward comes contiguous, and one copy costs less than the
    reference's passes."""
    grad_y = grad_y.contiguous(memory_format=torch.channels_last)
    if not _fits(x, grad_y) or (relu and x.shape[1] % 8) or (residual and not relu):
        return None
    if weight.dtype != torch.float32:
        return None
    key = ("bwd", x.device, tuple(x.shape), x.dtype, relu, residual)
    plan = _cached(
        key, lambda: _build_backward(grad_y, x, mask, weight, mean, invstd, relu, residual)
    )
    if plan is None:
        return None
    return _run_backward(plan, grad_y, x, mask, weight, mean, invstd, residual)


def _build_backward(grad_y, x, mask, weight, mean, invstd, relu, residual) -> _Plan:
    import cudnn

    c = x.shape[1]
    io = _io_type(x.dtype)
    g = _new_graph(x)
    shape, stride = list(x.shape), list(x.stride())
    t = {
        "x": g.tensor(name="x", dim=shape, stride=stride, data_type=io),
        "dy": g.tensor(name="dy", dim=shape, stride=stride, data_type=io),
        "scale": _vector(g, "scale", c),
        "mean": _vector(g, "mean", c),
        "invstd": _vector(g, "invstd", c),
    }
    grad = t["dy"]
    if relu:  # the bit mask, described as booleans of the full shape
        t["mask"] = g.tensor(
            name="mask", dim=shape, stride=stride, data_type=cudnn.data_type.BOOLEAN
        )
        grad = g.mul(name="drelu", a=grad, b=t["mask"])
        grad.set_data_type(io)
        if residual:
            t["dz"] = grad
            grad.set_output(True)
    dx, dscale, dbias = g.batchnorm_backward(
        name="dbn", grad=grad, input=t["x"], scale=t["scale"], mean=t["mean"],
        inv_variance=t["invstd"],
    )  # fmt: skip
    dx.set_output(True).set_data_type(io)
    for out in (dscale, dbias):
        out.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    t.update(dx=dx, dscale=dscale, dbias=dbias)
    _finish(g)
    plan = _Plan(g, t)

    def run(workspace: int) -> None:
        plan.workspace = workspace
        _run_backward(plan, grad_y, x, mask, weight, mean, invstd, residual)

    key = ("bn backward", x.shape, x.stride(), x.dtype, relu, residual is not None)
    select_fastest(g, run, limit=PLANS_TIMED, key=key, device=x.device)
    plan.workspace = g.get_workspace_size()
    return plan


def _run_backward(plan: _Plan, grad_y, x, mask, weight, mean, invstd, residual):
    t = plan.tensors
    gx = torch.empty_like(x, memory_format=torch.channels_last)
    gw, gb = torch.empty_like(weight), torch.empty_like(weight)
    binds = {t["x"]: x, t["dy"]: grad_y, t["scale"]: weight, t["mean"]: mean,
             t["invstd"]: invstd, t["dx"]: gx, t["dscale"]: gw, t["dbias"]: gb}  # fmt: skip
    if "mask" in t:
        binds[t["mask"]] = mask
    grad_residual = x.new_empty((0,))
    if residual:
        grad_residual = torch.empty_like(grad_y, memory_format=torch.channels_last)
        binds[t["dz"]] = grad_residual
    execute(plan.graph, binds, plan.workspace, x.device)
    return gx, gw, gb, grad_residual
