"""Each Triton kernel against its torch path on the GPU, side by side (skipped without CUDA).

- normalize: a 256 x 224 x 224 uint8 NHWC batch to bf16 channels_last, GB/s counting bytes read
  plus written (target: at least 70% of the device-to-device copy bandwidth, also measured here);
- SGD: one update of ResNet-50's parameter set, against torch's foreach and fused SGD;
- cross-entropy with label smoothing, forward + backward, batch 256 x 1000 classes;
- max-pool 3x3/2 of ResNet-50's stem (256 x 64 x 112 x 112 bf16 channels_last), forward +
  backward, against inductor's (compiled) and eager torch's: the window kernels by tile, the
  row kernels (``maxpool_rows``, what the stem runs) at their default tiles;
- its backward alone (fp16), and the same pool of ``relu(x * scale + bias)`` (the fused path's
  stem, fp16) forward alone: both kinds of kernel, each by tile;
- the fused path's stem after its convolution (BN + ReLU + max-pool, fp16, compiled), forward +
  backward: the whole BN in the pool (``bn_pool.bn_relu_max_pool2d``), its normalise + ReLU
  alone in the pool (``affine_relu_max_pool2d``), and torch's modules; and the backward kernel
  with the BN folded in by tile.
Timing is pedantic: each round is ``ITER`` calls between two device syncs, after warm-up rounds.
The normalize group replays its ``ITER`` calls from a CUDA graph: a call takes about 50 us on
the GPU, less than the host takes to launch it from Python on a busy machine, and what is
measured is the kernel's bandwidth, not the launch rate (the trainer calls it once per step).
"""

from __future__ import annotations

import pytest
import torch

ITER = 50


def run(benchmark, fn, bytes_moved: int | None = None, graphed: bool = False) -> None:
    def calls() -> None:
        for _ in range(ITER):
            fn()

    if graphed:
        fn()  # compiles (Triton) and allocates before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()

    def block() -> None:
        graph.replay() if graphed else calls()
        torch.cuda.synchronize()

    benchmark.pedantic(block, rounds=10, iterations=1, warmup_rounds=2)
    per_call = benchmark.stats.stats.median / ITER
    benchmark.extra_info["us_per_call"] = per_call * 1e6
    if bytes_moved is not None:
        benchmark.extra_info["GB_per_s"] = bytes_moved / per_call / 1e9


@pytest.fixture(scope="module")
def images():
    return torch.randint(0, 256, (256, 224, 224, 3), dtype=torch.uint8, device="cuda")


MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


@pytest.mark.benchmark(group="kernels: normalize")
@pytest.mark.parametrize(
    "impl", ["triton", "triton, with flip", "torch", "copy (bandwidth reference)"]
)
def test_normalize(benchmark, images, impl):
    from fasttrain.kernels.normalize import normalize, normalize_reference

    mean = torch.tensor(MEAN, device="cuda")
    std = torch.tensor(STD, device="cuda")
    out = torch.empty(images.shape, dtype=torch.bfloat16, device="cuda").permute(0, 3, 1, 2)
    n = images.numel()
    if impl == "triton":
        fn = lambda: normalize(images, mean, std, out=out)  # noqa: E731
    elif impl == "triton, with flip":
        flip = torch.rand(images.shape[0], device="cuda") < 0.5
        fn = lambda: normalize(images, mean, std, flip, out=out)  # noqa: E731
    elif impl == "torch":
        fn = lambda: normalize_reference(images, mean, std)  # noqa: E731
    else:
        src = torch.empty(3 * n // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        fn = lambda: dst.copy_(src)  # noqa: E731
    run(benchmark, fn, bytes_moved=3 * n, graphed=True)


@pytest.mark.benchmark(group="kernels: SGD update, ResNet-50 parameters")
@pytest.mark.parametrize("impl", ["triton", "triton lars", "torch fused", "torch foreach"])
def test_sgd(benchmark, impl):
    import torchvision
    from fasttrain.kernels.sgd import FusedSGD

    from fasttrain.model.build import param_groups

    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    groups = param_groups(model, 5e-5, bn_weight_decay=False)
    if impl.startswith("triton"):
        opt = FusedSGD(groups, lr=torch.tensor(0.1, device="cuda"), lars=impl.endswith("lars"))
    else:
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        kind = "fused" if impl == "torch fused" else "foreach"
        opt = torch.optim.SGD(
            groups, lr=torch.tensor(0.1, device="cuda"), momentum=0.9, **{kind: True}
        )
    if impl.startswith("triton"):
        opt.flat_grad.normal_(0, 1e-3)
    opt.step()  # momentum buffers exist from here on
    run(benchmark, opt.step)
    benchmark.extra_info["params"] = sum(p.numel() for p in model.parameters())


@pytest.mark.benchmark(group="kernels: cross-entropy fwd+bwd")
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cross_entropy(benchmark, impl):
    from fasttrain.kernels.cross_entropy import cross_entropy, cross_entropy_reference

    logits = torch.randn(256, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 1000, (256,), device="cuda")
    fn = cross_entropy if impl == "triton" else cross_entropy_reference

    def step() -> None:
        fn(logits, labels, 0.1).backward()

    run(benchmark, step)


MAXPOOL_TILES = [(32, 64, 4), (64, 64, 4), (16, 64, 2), (64, 64, 8), (128, 64, 8)]
# the row kernels' tiles: output rows per program, output columns, channels, warps
ROW_TILES = [(r, w, 64, nw) for r in (4, 8, 14) for w in (8, 16, 32, 64) for nw in (4, 8)]


def _tile(impl: str) -> tuple[int, ...]:
    return tuple(int(v) for v in impl.split()[-1].split("x"))


def _kernels(monkeypatch, impl: str, fwd: str, bwd: str | None = None) -> None:
    """Point fasttrain's max-pool at the kernels and tile ``impl`` names: "windows PxCxW" (the
    window kernels' tile attributes ``fwd`` and ``bwd``) or "rows RxWxCxW" (the row kernels')."""
    from fasttrain.kernels import maxpool, maxpool_rows

    rows = impl.startswith("rows")
    monkeypatch.setattr(maxpool, "ROWS", rows)
    module = maxpool_rows if rows else maxpool
    names = ("TILE_FWD", "TILE_BWD") if rows else (fwd, bwd)
    for name in names:
        if name is not None:
            monkeypatch.setattr(module, name, _tile(impl))


@pytest.mark.benchmark(group="kernels: max-pool 3x3/2 fwd+bwd")
@pytest.mark.parametrize(
    "impl",
    [f"windows {p}x{c}x{w}" for p, c, w in MAXPOOL_TILES] + ["rows", "torch compiled", "torch"],
)
def test_maxpool(benchmark, impl, monkeypatch):
    import torch.nn.functional as F
    from fasttrain.kernels import maxpool, maxpool_rows

    cl = torch.channels_last
    x = torch.randn(256, 64, 112, 112, device="cuda", dtype=torch.bfloat16).to(memory_format=cl)
    x.requires_grad_(True)
    grad = torch.randn(256, 64, 56, 56, device="cuda", dtype=torch.bfloat16)
    grad = grad.to(memory_format=cl)
    if impl.startswith("windows"):
        _kernels(monkeypatch, impl, "TILE_FWD", "TILE_BWD")
        fn = lambda t: maxpool.max_pool2d(t, 3, 2, 1)  # noqa: E731
    elif impl == "rows":  # the row kernels at their default tiles
        monkeypatch.setattr(maxpool, "ROWS", True)
        fn = lambda t: maxpool.max_pool2d(t, 3, 2, 1)  # noqa: E731
        benchmark.extra_info["tiles"] = [maxpool_rows.TILE_FWD, maxpool_rows.TILE_BWD]
    elif impl == "torch compiled":
        fn = torch.compile(lambda t: F.max_pool2d(t, 3, 2, 1), dynamic=False)
    else:
        fn = lambda t: F.max_pool2d(t, 3, 2, 1)  # noqa: E731

    def step() -> None:
        x.grad = None
        fn(x).backward(grad)

    run(benchmark, step)
    # the least a forward + backward moves: input read, output (+ int8 offsets) written, then
    # the gradient and offsets read and the input's gradient written
    n_in, n_out = x.numel(), grad.numel()
    benchmark.extra_info["GB_per_s"] = (
        (2 * n_in + 2 * n_out + n_out) + (2 * n_out + n_out + 2 * n_in)
    ) / (benchmark.extra_info["us_per_call"] * 1e3)


@pytest.mark.benchmark(group="kernels: max-pool 3x3/2 backward")
@pytest.mark.parametrize(
    "impl",
    [f"windows {p}x{c}x{w}" for p, c, w in MAXPOOL_TILES]
    + [f"rows {r}x{w}x{c}x{nw}" for r, w, c, nw in ROW_TILES],
)
def test_maxpool_backward(benchmark, impl, monkeypatch):
    """The pool's backward alone (fp16, the fused path's dtype), by kernel and tile: the
    gradient and the int8 offsets read, the input's gradient written."""
    from fasttrain.kernels import maxpool

    cl = torch.channels_last
    x = torch.randn(256, 64, 112, 112, device="cuda", dtype=torch.float16).to(memory_format=cl)
    _kernels(monkeypatch, impl, "TILE_FWD", "TILE_BWD")
    offsets = maxpool._pool(x, 3, 2, 1)[1]
    grad = torch.randn(256, 64, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=cl)

    def fn():
        return maxpool.pool_backward(grad, offsets, 112, 112, True, 3, 2, 1)

    run(benchmark, fn, bytes_moved=2 * x.numel() + 3 * grad.numel())


AFFINE_TILES = [(p, 64, w) for p in (32, 64, 128, 256) for w in (4, 8)]


@pytest.mark.benchmark(group="kernels: max-pool of relu(x * scale + bias), forward")
@pytest.mark.parametrize(
    "impl",
    [f"windows {p}x{c}x{w}" for p, c, w in AFFINE_TILES]
    + [f"rows {r}x{w}x{c}x{nw}" for r, w, c, nw in ROW_TILES]
    + ["torch compiled"],
)
def test_affine_maxpool_forward(benchmark, impl, monkeypatch):
    """The fused path's stem: the max-pool of its BN's normalise + ReLU, fp16 at batch 256, by
    the Triton forward by kernel and tile (``TILE_AFFINE_FWD`` is the window kernel's fastest on
    an H200, ``maxpool_rows.TILE_FWD`` the row kernel's) or by inductor compiling the same
    function (which writes no argmax; its backward recomputes it)."""
    import torch.nn.functional as F
    from fasttrain.kernels import maxpool

    cl = torch.channels_last
    x = torch.randn(256, 64, 112, 112, device="cuda", dtype=torch.float16).to(memory_format=cl)
    scale = torch.rand(64, device="cuda") + 0.5
    bias = torch.randn(64, device="cuda") * 0.1
    if impl.startswith(("windows", "rows")):
        _kernels(monkeypatch, impl, "TILE_AFFINE_FWD")

        def fn():
            return maxpool.affine_relu_pool(x, scale, bias, 3, 2, 1)
    else:
        pool = torch.compile(
            lambda t, s, b: F.max_pool2d(torch.relu(t * s.view(1, -1, 1, 1) + b.view(1, -1, 1, 1))
                                         .to(t.dtype), 3, 2, 1),
            dynamic=False,
        )  # fmt: skip

        def fn():
            return pool(x, scale, bias)

    # the least it moves: the input read, the output and the int8 argmax written
    run(benchmark, fn, bytes_moved=2 * x.numel() + 3 * x.numel() // 4)


def _stem_input():
    cl = torch.channels_last
    y = torch.randn(256, 64, 112, 112, device="cuda", dtype=torch.float16).to(memory_format=cl)
    return y, torch.randn(256, 64, 56, 56, device="cuda", dtype=torch.float16).to(memory_format=cl)


@pytest.mark.benchmark(group="kernels: stem BN + ReLU + max-pool, fwd+bwd, compiled")
@pytest.mark.parametrize(
    "impl", ["whole BN in the pool", "normalise + ReLU in the pool (the default)", "torch modules"]
)
def test_stem_bn_relu_maxpool(benchmark, impl):
    """What the fused path's stem runs after its convolution, forward + backward at batch 256
    (fp16, each compiled whole as the step compiles it): the whole BN inside the Triton pool,
    whose backward writes only the input's gradient; the BN's normalise + ReLU inside it, the
    statistics and their backward by inductor (reading the pool's gradient twice); or
    ``nn.BatchNorm2d``, ReLU and ``F.max_pool2d`` as inductor compiles them."""
    import torch.nn.functional as F

    from fasttrain.model.ops.bn_pool import affine_relu_max_pool2d, bn_relu_max_pool2d
    from fasttrain.model.ops.conv_bn import bn_finalize, sums

    y, grad = _stem_input()
    y.requires_grad_(True)
    bn = torch.nn.BatchNorm2d(64).cuda()
    count = y.shape[0] * y.shape[2] * y.shape[3]
    if impl.startswith("whole"):
        fn = lambda t: bn_relu_max_pool2d(t, bn, 3, 2, 1)  # noqa: E731
    elif impl.startswith("normalise"):
        fn = lambda t: affine_relu_max_pool2d(t, *bn_finalize(*sums(t), count, bn), 3, 2, 1)  # noqa: E731
    else:
        fn = lambda t: F.max_pool2d(torch.relu(bn(t)), 3, 2, 1)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def step() -> None:
        y.grad = None
        compiled(y).backward(grad)

    run(benchmark, step)


@pytest.mark.benchmark(group="kernels: max-pool 3x3/2 backward with the BN folded in")
@pytest.mark.parametrize("impl", [f"rows {r}x{w}x{c}x{nw}" for r, w, c, nw in ROW_TILES])
def test_maxpool_bn_backward(benchmark, impl, monkeypatch):
    """The row kernels' backward with the stem's BN folded in (``affine_relu_pool_backward``,
    fp16) by tile: the gradient, the int8 offsets and the BN's input read, the input's
    gradient written (``maxpool_rows.TILE_BN_BWD`` is the fastest)."""
    from fasttrain.kernels import maxpool, maxpool_rows

    y, grad = _stem_input()
    monkeypatch.setattr(maxpool, "ROWS", True)
    monkeypatch.setattr(maxpool_rows, "TILE_BN_BWD", _tile(impl))
    per_channel = [torch.randn(64, device="cuda") for _ in range(4)]
    offsets = maxpool.affine_relu_pool(y, *per_channel[:2], 3, 2, 1)[1]

    def fn():
        return maxpool.affine_relu_pool_backward(grad, offsets, y, *per_channel, 3, 2, 1)

    run(benchmark, fn, bytes_moved=4 * y.numel() + 3 * grad.numel())
