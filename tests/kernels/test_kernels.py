"""Triton kernels against their torch references: on the GPU when there is one, else in Triton's
interpreter on the CPU (``TRITON_INTERPRET=1``, set by conftest.py before torch is imported), on
random inputs with odd sizes and tails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fasttrain.kernels.cross_entropy import CrossEntropy, cross_entropy, cross_entropy_reference
from fasttrain.kernels.normalize import normalize, normalize_reference
from fasttrain.kernels.sgd import FusedSGD, lars_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MEAN = torch.tensor([123.675, 116.28, 103.53], device=DEV)
STD = torch.tensor([58.395, 57.12, 57.375], device=DEV)


@pytest.mark.parametrize("shape", [(3, 7, 5, 3), (2, 33, 17, 3), (1, 1, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_flip", [False, True])
def test_normalize_matches_reference(shape, dtype, with_flip):
    g = torch.Generator().manual_seed(sum(shape))
    images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).to(DEV)
    flip = (torch.rand(shape[0], generator=g) < 0.5).to(DEV) if with_flip else None
    if flip is not None:
        flip[0] = True  # at least one flipped sample
    got = normalize(images, MEAN, STD, flip, dtype=dtype, tile=(2, 16, 1))  # small: tails
    want = normalize_reference(images, MEAN, STD, flip, dtype=dtype)
    assert got.shape == want.shape == (shape[0], 3, shape[1], shape[2]) and got.dtype == dtype
    assert got.is_contiguous(memory_format=torch.channels_last)
    # the same fp32 math; Triton's CPU interpreter rounds to bf16/fp16 toward zero where the GPU
    # rounds to nearest, so allow one unit in the last place
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps)


def test_normalize_fills_a_given_buffer_in_place():
    images = torch.randint(0, 256, (2, 5, 6, 3), dtype=torch.uint8).to(DEV)
    out = torch.empty(2, 5, 6, 3, dtype=torch.bfloat16, device=DEV).permute(0, 3, 1, 2)
    got = normalize(images, MEAN, STD, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = normalize_reference(images, MEAN, STD)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps)


@pytest.mark.parametrize("rows, classes", [(5, 10), (13, 1000), (3, 4099)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_forward_and_backward_match_torch(rows, classes, smoothing):
    g = torch.Generator().manual_seed(rows * classes)
    logits = (torch.randn(rows, classes, generator=g) * 3).to(DEV)
    labels = torch.randint(0, classes, (rows,), generator=g).to(DEV)
    labels[-1] = -1  # an ignored (padding) row
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss_a = cross_entropy(a, labels, smoothing)
    loss_b = cross_entropy_reference(b, labels, smoothing)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    (loss_a * 2.5).backward()
    (loss_b * 2.5).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert a.grad[-1].abs().max() == 0  # the ignored row gets no gradient


def test_cross_entropy_is_one_op_to_torch_compile():
    """The custom op compiles as an opaque call: compiled and eager give the same loss."""
    logits = torch.randn(6, 11, device=DEV, requires_grad=True)
    labels = torch.randint(0, 11, (6,), device=DEV)
    loss_fn = CrossEntropy(label_smoothing=0.1)
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(logits, labels), loss_fn(logits, labels))
    torch.library.opcheck(torch.ops.fasttrain.cross_entropy_ls, (logits, labels, 0.1))


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 5, 3),
        torch.nn.BatchNorm2d(5),
        torch.nn.Flatten(),
        torch.nn.Linear(5 * 3 * 3, 7),
    ).to(DEV)
    return m.to(memory_format=torch.channels_last)


def _groups(m):
    bn = [p for p in m[1].parameters()]
    other = [p for p in m.parameters() if all(p is not q for q in bn)]
    return [{"params": other, "weight_decay": 1e-2}, {"params": bn, "weight_decay": 0.0}]


def _image_batch(g):
    x = torch.randn(8, 3, 5, 5, generator=g).to(DEV)
    return x.contiguous(memory_format=torch.channels_last)


def _train(m, opt, steps=4):
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = (
            torch.randn(8, 3, 5, 5, generator=g)
            .to(DEV)
            .contiguous(memory_format=torch.channels_last)
        )
        y = torch.randint(0, 7, (8,), generator=g).to(DEV)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        for group in opt.param_groups:
            group["lr"] = 0.1 / (i + 1)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_fused_sgd_matches_torch_sgd_over_steps():
    ref, fused = _model(), _model()
    torch_opt = torch.optim.SGD(_groups(ref), lr=0.1, momentum=0.9, foreach=True)
    opt = FusedSGD(_groups(fused), lr=0.1, momentum=0.9)
    assert fused[0].weight.is_contiguous(memory_format=torch.channels_last)  # layout kept
    _train(ref, torch_opt)
    _train(fused, opt)
    for p, q in zip(fused.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opt.flat_grad.abs().max() == 0  # zero_grad zeroed the flat buffer in place
    flat = opt.flat_grad.untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == flat for p in fused.parameters())


@pytest.mark.parametrize("accum", [1, 2])
def test_fused_sgd_through_the_trainers_step_matches_torch_sgd(accum):
    """The trainer's eager step (micro-batches summed into the flat gradients, zero_grad with
    set_to_none, the LR from the schedule) updates as torch's SGD does, in fp32. On an H200 the
    free-running bf16 comparison drifted (BENCHMARKS.md); this holds the update rule itself."""
    from fasttrain.config import OptimConfig
    from fasttrain.metrics.meter import DeviceMeter
    from fasttrain.step.optim import build_schedule
    from fasttrain.step.step import build_step

    schedule = build_schedule(OptimConfig(warmup_epochs=0.5), 16, 4, 1)
    g = torch.Generator().manual_seed(3)
    data = [
        (_image_batch(g), torch.randint(0, 7, (8,), generator=g).to(DEV)) for _ in range(4 * accum)
    ]
    results = []
    for fused in (False, True):
        m = _model()
        opt = (
            FusedSGD(_groups(m), lr=0.1, momentum=0.9)
            if fused
            else torch.optim.SGD(_groups(m), lr=0.1, momentum=0.9)
        )
        step = build_step(
            model=m,
            optimizer=opt,
            criterion=torch.nn.CrossEntropyLoss(label_smoothing=0.1),
            amp_dtype=None,
            scaler=None,
            schedule=schedule,
            compile=False,
            cuda_graphs=False,
        )
        # the optimizer's type declares that its gradients stay in place (zeroed in the graph)
        assert step.grads_in_place is fused
        meter = DeviceMeter(torch.device(DEV))
        for i in range(4):
            step(data[i * accum : (i + 1) * accum], meter, i)
        results.append([p.detach().clone() for p in m.parameters()])
    for p, q in zip(*results, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["triton", "foreach"])
def test_fused_lars_matches_the_reference_rule(impl):
    """The Triton kernel and the foreach form (``fasttrain.lars``: the CPU's and DDP's) both
    take the reference rule's steps, with a device LR."""
    from fasttrain.step.lars import Lars

    ref, fused = _model(), _model()
    if impl == "triton":
        opt = FusedSGD(_groups(fused), lr=0.1, momentum=0.9, lars=True, eta=0.02)
    else:
        opt = Lars(_groups(fused), lr=0.1, momentum=0.9, eta=0.02)
    groups = _groups(ref)
    bufs = {id(p): torch.zeros_like(p) for g in groups for p in g["params"]}
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x = (
            torch.randn(8, 3, 5, 5, generator=g)
            .to(DEV)
            .contiguous(memory_format=torch.channels_last)
        )
        y = torch.randint(0, 7, (8,), generator=g).to(DEV)
        for m in (ref, fused):
            torch.nn.functional.cross_entropy(m(x), y).backward()
        for group in groups:
            ps = group["params"]
            lars_reference(
                ps,
                [p.grad for p in ps],
                [bufs[id(p)] for p in ps],
                0.1 / (i + 1),
                0.9,
                group["weight_decay"],
                0.02,
                lars=True,
            )
        for group in opt.param_groups:
            group["lr"] = torch.tensor(0.1 / (i + 1), device=DEV)  # a device LR, as graphed
        opt.step()
        opt.zero_grad()
        ref.zero_grad(set_to_none=True)
    for p, q in zip(fused.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fused_sgd_resumes_from_a_torch_style_state_dict():
    m = _model()
    opt = FusedSGD(_groups(m), lr=0.1, momentum=0.9)
    _train(m, opt, steps=2)
    state = opt.state_dict()
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    opt2 = FusedSGD(_groups(m2), lr=0.1, momentum=0.9)
    opt2.load_state_dict(state)
    for p in m2.parameters():  # momentum landed in the flat buffer's views
        buf = opt2.state[p]["momentum_buffer"]
        assert buf.untyped_storage().data_ptr() == opt2.flat_buf.untyped_storage().data_ptr()
    torch.testing.assert_close(opt2.flat_buf, opt.flat_buf)


def test_foreach_lars_unscales_and_skips_from_grad_scaler_tensors():
    """The foreach LARS under GradScaler: an unscaled step's update, and nothing changed by a
    step whose gradients hold an inf (NaN momentum included)."""
    from fasttrain.step.lars import Lars

    ref, scaled = _model(), _model()
    opt_ref = Lars(_groups(ref), lr=0.1, momentum=0.9, eta=0.02)
    opt = Lars(_groups(scaled), lr=torch.tensor(0.1, device=DEV), momentum=0.9, eta=0.02)
    scaler = torch.amp.GradScaler(DEV.type, init_scale=1024.0, growth_interval=1000)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = _image_batch(g), torch.randint(0, 7, (8,), generator=g).to(DEV)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        scaler.scale(torch.nn.functional.cross_entropy(scaled(x), y)).backward()
        opt_ref.step()
        scaler.step(opt)
        scaler.update()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    for p, q in zip(scaled.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    before = [p.clone() for p in scaled.parameters()]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in scaled.parameters()]
    scaler.scale(torch.nn.functional.cross_entropy(scaled(_image_batch(g)), y)).backward()
    next(scaled.parameters()).grad[0].fill_(float("nan"))
    scaler.step(opt)
    scaler.update()
    for p, before_p, before_b in zip(scaled.parameters(), before, bufs, strict=True):
        assert torch.equal(p, before_p)
        assert torch.equal(opt.state[p]["momentum_buffer"], before_b)
    assert scaler.get_scale() == 512.0


@pytest.mark.parametrize("lars", [False, True], ids=["sgd", "lars"])
def test_fused_sgd_unscales_and_skips_from_grad_scaler_tensors(lars):
    """Under GradScaler (fp16) the optimizer gets the scale and the inf check as device tensors
    (``_step_supports_amp_scaling``), with no host read, so the step can be captured. The update
    must equal an unscaled step; a step with an inf gradient must change nothing."""
    ref, fused = _model(), _model()
    torch_opt = torch.optim.SGD(_groups(ref), lr=0.1, momentum=0.9)
    opt = FusedSGD(_groups(fused), lr=0.1, momentum=0.9, lars=lars, eta=0.02)
    scaler = torch.amp.GradScaler(DEV.type, init_scale=1024.0, growth_interval=1000)
    bufs = {id(p): torch.zeros_like(p) for g in _groups(ref) for p in g["params"]}
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = _image_batch(g)
        y = torch.randint(0, 7, (8,), generator=g).to(DEV)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        scaler.scale(torch.nn.functional.cross_entropy(fused(x), y)).backward()
        if lars:
            for group in _groups(ref):
                ps = group["params"]
                grads, b = [p.grad for p in ps], [bufs[id(p)] for p in ps]
                lars_reference(ps, grads, b, 0.1, 0.9, group["weight_decay"], 0.02, lars=True)
        else:
            torch_opt.step()
        scaler.step(opt)
        scaler.update()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        opt.zero_grad()
        ref.zero_grad(set_to_none=True)
    for p, q in zip(fused.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    # an inf in one gradient: GradScaler's check finds it and the kernel skips the update
    before = opt.flat_param.clone(), opt.flat_buf.clone()
    scaler.scale(torch.nn.functional.cross_entropy(fused(_image_batch(g)), y)).backward()
    next(fused.parameters()).grad[0].fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(opt.flat_param, before[0]) and torch.equal(opt.flat_buf, before[1])
    assert scaler.get_scale() == 512.0  # halved for the inf, as for any optimizer


@pytest.mark.parametrize(
    "shape, pool, channels_last, dtype",
    [
        ((2, 5, 9, 7), (3, 2, 1), True, torch.float32),  # ResNet's stem pool, odd sizes
        ((1, 70, 6, 5), (3, 2, 1), True, torch.bfloat16),  # channels past one 64-wide tile
        ((3, 3, 8, 8), (2, 2, 0), False, torch.float32),  # NCHW, windows that do not overlap
        ((1, 4, 5, 6), (3, 1, 1), True, torch.float32),  # stride 1: an input in up to 9 windows
    ],
)
def test_maxpool_forward_and_backward_match_torch(shape, pool, channels_last, dtype):
    from fasttrain.kernels.maxpool import max_pool2d

    g = torch.Generator().manual_seed(sum(shape))
    # small integers: many ties, where the first maximum in the window must take the gradient
    x = torch.randint(0, 4, shape, generator=g).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x = x.to(DEV)
    a = x.clone().requires_grad_()
    b = x.float().requires_grad_()  # the reference in fp32: torch's bf16 backward adds in bf16
    out_a, out_b = max_pool2d(a, *pool), F.max_pool2d(b, *pool)
    assert out_a.dtype == dtype and out_a.stride() == out_b.stride()
    torch.testing.assert_close(out_a.float(), out_b, rtol=0, atol=0)
    grad = torch.randn(out_b.shape, generator=g).to(dtype).to(DEV)
    out_a.backward(grad)
    out_b.backward(grad.float())
    assert a.grad.stride() == b.grad.stride()
    # one gradient may be the sum of several windows', added in another order than torch's
    tol = max(torch.finfo(dtype).eps, 1e-5)
    torch.testing.assert_close(a.grad.float(), b.grad, rtol=tol, atol=tol)


def test_maxpool_takes_inf_and_nan_as_torch_does():
    from fasttrain.kernels.maxpool import max_pool2d

    inf, nan = float("inf"), float("nan")
    for x in (
        torch.full((1, 1, 3, 3), -inf),  # nothing beats -inf: the first in-bounds element wins
        torch.tensor([[[[1.0, nan, 2.0], [3.0, 5.0, nan], [0.0, 4.0, 1.0]]]]),  # NaN propagates
    ):
        a = x.to(DEV).requires_grad_()
        b = x.to(DEV).detach().clone().requires_grad_()  # its own leaf, also where DEV is the CPU
        out_a, out_b = max_pool2d(a, 3, 2, 1), F.max_pool2d(b, 3, 2, 1)
        torch.testing.assert_close(out_a, out_b, equal_nan=True)
        out_a.sum().backward()
        out_b.sum().backward()
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(
    "shape, dtype, affine",
    [
        ((2, 5, 9, 7), torch.float32, False),  # odd sizes: the last row and column pad
        ((1, 6, 12, 10), torch.float16, False),  # even sizes: the last input row from a carry
        ((2, 9, 13, 16), torch.float16, True),  # the fused stem's affine + ReLU
        ((1, 2, 1, 1), torch.float32, False),  # one pixel
    ],
)
def test_maxpool_row_kernels_match_the_window_kernels(shape, dtype, affine, monkeypatch):
    """The stem's 3x3/2 pad-1 pool by ``maxpool_rows`` against the window kernels: the same
    values and int8 argmax offsets (ties, -inf and NaN included), and the same input gradient
    (small integers, so any order of adding them is exact). Tiles of 3 rows x 4 columns x 4
    channels put strip and tile edges inside these sizes."""
    from fasttrain.kernels import maxpool, maxpool_rows

    monkeypatch.setattr(maxpool_rows, "TILE_FWD", (3, 4, 4, 1))
    monkeypatch.setattr(maxpool_rows, "TILE_BWD", (3, 4, 4, 1))
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(-2, 3, shape, generator=g).to(dtype)
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:3]] = float("-inf")
    x.view(-1)[torch.randperm(x.numel(), generator=g)[:2]] = float("nan")
    x = x.to(memory_format=torch.channels_last).to(DEV)
    scale = (torch.rand(shape[1], generator=g) + 0.5).to(DEV)
    bias = torch.randn(shape[1], generator=g).to(DEV)
    grad = torch.randint(-8, 9, (shape[0], shape[1], (shape[2] + 1) // 2, (shape[3] + 1) // 2))
    grad = grad.to(dtype).to(memory_format=torch.channels_last).to(DEV)
    results = []
    for rows in (True, False):
        monkeypatch.setattr(maxpool, "ROWS", rows)
        if affine:
            out, offsets = maxpool.affine_relu_pool(x, scale, bias, 3, 2, 1)
        else:
            out, offsets = maxpool._pool(x, 3, 2, 1)
        dx = maxpool.pool_backward(grad, offsets, *shape[2:], True, 3, 2, 1)
        results.append((out, offsets, dx))
    (out, offsets, dx), (want_out, want_offsets, want_dx) = results
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(offsets, want_offsets)
    assert dx.stride() == want_dx.stride() and torch.equal(dx, want_dx)


@pytest.mark.parametrize("shape", [(2, 9, 13, 16), (1, 6, 11, 9)])
def test_maxpool_row_kernels_pick_and_fold_the_bn(shape, monkeypatch):
    """The stem's fused pool with the BN folded in (``maxpool.affine_relu_pool_picked`` and
    ``affine_relu_pool_backward``): the same values and offsets as ``affine_relu_pool``, the
    input each output took (looked up by its offset), and the input's gradient as torch composes
    it from the pool's gradient: masked by ``y * scale + bias > 0``, times the scale, plus
    ``c0 + c1 * y`` (ties, -inf and NaN in ``y``; fp16)."""
    from fasttrain.kernels import maxpool, maxpool_rows

    monkeypatch.setattr(maxpool_rows, "TILE_FWD", (3, 4, 4, 1))
    monkeypatch.setattr(maxpool_rows, "TILE_BWD", (3, 4, 4, 1))
    monkeypatch.setattr(maxpool_rows, "TILE_BN_BWD", (3, 4, 4, 1))
    g = torch.Generator().manual_seed(sum(shape))
    y = torch.randint(-2, 3, shape, generator=g).half()
    y.view(-1)[torch.randperm(y.numel(), generator=g)[:3]] = float("-inf")
    y.view(-1)[torch.randperm(y.numel(), generator=g)[:2]] = float("nan")
    y = y.to(memory_format=torch.channels_last).to(DEV)
    c = shape[1]
    scale, bias, c0, c1 = (torch.randn(c, generator=g).to(DEV) for _ in range(4))
    out, offsets, picked = maxpool.affine_relu_pool_picked(y, scale, bias, 3, 2, 1)
    want_out, want_offsets = maxpool.affine_relu_pool(y, scale, bias, 3, 2, 1)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(offsets, want_offsets) and picked.stride() == out.stride()
    # the input at each output's argmax: window row kh, column kw from (2 oh - 1, 2 ow - 1)
    oh, ow = out.shape[2:]
    o = offsets.permute(0, 3, 1, 2).long()
    rows = 2 * torch.arange(oh, device=DEV).view(1, 1, -1, 1) - 1 + o // 3
    cols = 2 * torch.arange(ow, device=DEV).view(1, 1, 1, -1) - 1 + o % 3
    flat = (rows * shape[3] + cols).flatten(2)
    want_picked = y.flatten(2).gather(2, flat).view(out.shape)
    torch.testing.assert_close(picked, want_picked, rtol=0, atol=0, equal_nan=True)

    grad = torch.randint(-8, 9, out.shape, generator=g).half()
    grad = grad.to(memory_format=torch.channels_last).to(DEV)
    dy = maxpool.affine_relu_pool_backward(grad, offsets, y, scale, bias, c0, c1, 3, 2, 1)
    ga = maxpool.pool_backward(grad, offsets, *shape[2:], True, 3, 2, 1)
    wide, per = y.float(), (lambda v: v.view(1, -1, 1, 1))
    live = ga.float() * (wide * per(scale) + per(bias) > 0)
    want = (live * per(scale) + per(c0) + per(c1) * wide).half()
    assert dy.stride() == y.stride()
    # fp32 arithmetic rounded once to fp16 both ways; a GPU may fuse a multiply-add
    torch.testing.assert_close(dy, want, rtol=1e-3, atol=1e-3, equal_nan=True)


def test_maxpool_swaps_into_the_model_with_the_same_state_dict_and_outputs():
    from fasttrain.kernels.maxpool import MaxPool2d

    from fasttrain.model.build import build_model

    torch.manual_seed(0)
    ref = build_model("resnet18", 4, True, DEV)
    model = build_model("resnet18", 4, True, DEV, triton_maxpool=True)
    assert isinstance(model.maxpool, MaxPool2d) and not isinstance(ref.maxpool, MaxPool2d)
    assert model.state_dict().keys() == ref.state_dict().keys()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32, device=DEV).to(memory_format=torch.channels_last)
    out, want = model(x), ref(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    want.square().sum().backward()
    # the pool's gradient sums overlapping windows in another order; BN over a batch of 2
    # amplifies that rounding on its way back to the first conv
    torch.testing.assert_close(model.conv1.weight.grad, ref.conv1.weight.grad, rtol=1e-3, atol=1e-3)
    assert not MaxPool2d.replaces(torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True))


def test_maxpool_under_torch_compile_matches_eager():
    """torch.compile calls the custom op as one op, forward and backward."""
    from fasttrain.kernels.maxpool import MaxPool2d

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1).to(DEV)
    x = torch.randn(2, 3, 12, 10, device=DEV).to(memory_format=torch.channels_last)

    def stem(w: torch.Tensor) -> torch.Tensor:
        return MaxPool2d(3, 2, 1)(torch.relu(F.conv2d(x, w, padding=1))).square().sum()

    w_eager = conv.weight.detach().clone().requires_grad_()
    w_compiled = conv.weight.detach().clone().requires_grad_()
    loss_eager = stem(w_eager)
    loss_compiled = torch.compile(stem, dynamic=False)(w_compiled)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-5)
    loss_eager.backward()
    loss_compiled.backward()
    torch.testing.assert_close(w_compiled.grad, w_eager.grad, rtol=1e-5, atol=1e-5)
