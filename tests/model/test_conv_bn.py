"""The fused model path's ops against plain torch: conv_bn and bn_finalize against nn.Conv2d +
nn.BatchNorm2d + ReLU, forward and backward, running statistics included, eager and compiled;
the normalise + ReLU passes and the block end; cuDNN's fused forward on a GPU. The stem's BN in
the Triton max-pool: test_bn_pool.py; the model built from them: test_fused_resnet.py."""

import copy
import functools

import pytest
import torch
from torch import nn

from fasttrain.model.ops.conv_bn import (
    affine,
    affine_relu,
    bn_finalize,
    cast_weight,
    conv_bn,
    residual_relu,
    stored,
)
from fasttrain.model.ops.signs import pack_signs, relu_and_signs, unpack_signs
from tests.conftest import partitioned_backward, randn_nhwc

# the Triton max-pool's tests run on the GPU where there is one, else interpreted on the CPU
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("prologue", [False, True])
@pytest.mark.parametrize("stride, padding, k", [(1, 1, 3), (2, 0, 1), (2, 3, 7)])
def test_conv_bn_matches_conv2d_and_its_sums_forward_and_backward(prologue, stride, padding, k):
    x = randn_nhwc(2, 4, 9, 9).requires_grad_()
    w = randn_nhwc(5, 4, k, k, seed=1).requires_grad_()
    scale = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_() if prologue else None
    bias = (torch.randn(4, dtype=torch.float64) * 0.3).requires_grad_() if prologue else None
    y, total, total_sq = conv_bn(x, w, scale, bias, stride, padding)
    a = torch.relu(x * scale.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)) if prologue else x
    ref = nn.functional.conv2d(a, w, stride=stride, padding=padding)
    torch.testing.assert_close(y, ref)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(total.double(), ref.sum((0, 2, 3)))
    torch.testing.assert_close(total_sq.double(), (ref * ref).sum((0, 2, 3)))
    # a loss that uses the output and both sums, so every gradient path is taken
    g = randn_nhwc(*y.shape, seed=2)
    c1, c2 = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    inputs = [t for t in (x, w, scale, bias) if t is not None]
    got = torch.autograd.grad((y * g).sum() + (total * c1).sum() + (total_sq * c2).sum(), inputs)
    ref_loss = (ref * g).sum() + (ref.sum((0, 2, 3)) * c1).sum()
    ref_loss = ref_loss + ((ref * ref).sum((0, 2, 3)) * c2).sum()
    want = torch.autograd.grad(ref_loss, inputs)
    for a_, b_ in zip(got, want, strict=True):
        torch.testing.assert_close(a_, b_)


def test_conv_bn_is_a_well_formed_custom_op():
    """Schema, fake (meta) implementation, autograd registration: torch.library's own checks."""
    x = randn_nhwc(2, 4, 8, 8, dtype=torch.float32).requires_grad_()
    w = randn_nhwc(6, 4, 3, 3, seed=1, dtype=torch.float32).requires_grad_()
    scale = torch.rand(4, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    torch.library.opcheck(conv_bn, (x, w, scale, bias, 1, 1))
    torch.library.opcheck(conv_bn, (x, w, None, None, 2, 1))


def test_cast_weight_is_a_well_formed_custom_op_with_the_casts_gradient():
    """``cast_weight`` passes torch.library's checks; its value is the cast, its gradient the
    incoming one cast back to the weight's dtype."""
    w = randn_nhwc(6, 4, 3, 3, dtype=torch.float32).requires_grad_()
    torch.library.opcheck(cast_weight, (w, torch.float16))
    half = cast_weight(w, torch.float16)
    assert half.dtype == torch.float16 and half.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(half, w.to(torch.float16))
    g = randn_nhwc(6, 4, 3, 3, seed=1, dtype=torch.float16)
    (got,) = torch.autograd.grad(half, w, g)
    assert got.dtype == torch.float32 and torch.equal(got, g.float())


def _reference_chain(conv1, bn1, conv2, bn2, x):
    return bn2(conv2(torch.relu(bn1(conv1(x)))))


def _fused_chain(conv1, bn1, conv2, bn2, x):
    a1, t1, q1 = conv_bn(x, conv1.weight, None, None, 1, 1)
    p1 = bn_finalize(t1, q1, a1.shape[0] * a1.shape[2] * a1.shape[3], bn1)
    a2, t2, q2 = conv_bn(a1, conv2.weight, *p1, 1, 1)
    return affine(a2, *bn_finalize(t2, q2, a2.shape[0] * a2.shape[2] * a2.shape[3], bn2))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_conv_bn_relu_chain_matches_the_modules_with_running_statistics(momentum):
    """conv -> BN -> ReLU -> conv -> BN, three training steps (fp64): the outputs, every
    gradient and the running statistics (momentum, unbiased variance, the batch count) agree;
    then eval mode, which normalises with the running statistics."""
    torch.manual_seed(0)
    mods = [
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8, momentum=momentum),
        nn.Conv2d(8, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6, momentum=momentum),
    ]
    for bn in mods[1::2]:
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.5, 0.5)
    ref = [m.double() for m in mods]
    fused = copy.deepcopy(ref)
    for step in range(3):
        x = randn_nhwc(4, 3, 6, 6, seed=10 + step)
        out_ref, out = _reference_chain(*ref, x), _fused_chain(*fused, x)
        torch.testing.assert_close(out, out_ref)
        g = randn_nhwc(*out.shape, seed=20 + step)
        params_ref = [p for m in ref for p in m.parameters()]
        params = [p for m in fused for p in m.parameters()]
        for a, b in zip(
            torch.autograd.grad((out * g).sum(), params),
            torch.autograd.grad((out_ref * g).sum(), params_ref),
            strict=True,
        ):
            torch.testing.assert_close(a, b)
        for bn, bn_ref in zip(fused[1::2], ref[1::2], strict=True):
            torch.testing.assert_close(bn.running_mean, bn_ref.running_mean)
            torch.testing.assert_close(bn.running_var, bn_ref.running_var)
            assert int(bn.num_batches_tracked) == int(bn_ref.num_batches_tracked) == step + 1
    for m in ref + fused:
        m.eval()
    x = randn_nhwc(2, 3, 6, 6, seed=99)
    torch.testing.assert_close(_fused_chain(*fused, x), _reference_chain(*ref, x))


@pytest.mark.parametrize("copy_affine", [True, False])
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_affine_relu_is_relu_of_affine_forward_and_backward(compiled, copy_affine):
    """affine_relu masks its gradient by the pre-activation it recomputes, torch.relu by its
    output: the same values and gradients (no pre-activation here is exactly zero), negative
    scales included; compiled into one graph (the scale and bias saved as copies or marked),
    the same."""
    y = randn_nhwc(4, 6, 5, 5).requires_grad_()
    scale = torch.linspace(-1.5, 2.0, 6, dtype=torch.float64).requires_grad_()
    bias = torch.linspace(-0.4, 0.6, 6, dtype=torch.float64).requires_grad_()
    g = randn_nhwc(4, 6, 5, 5, seed=3)
    fn = functools.partial(affine_relu, copy_affine=copy_affine)
    fn = torch.compile(fn, fullgraph=True) if compiled else fn
    out, ref = fn(y, scale, bias), torch.relu(affine(y, scale, bias))
    torch.testing.assert_close(out, ref)
    assert out.is_contiguous(memory_format=torch.channels_last)
    grads = torch.autograd.grad((out * g).sum(), (y, scale, bias))
    ref_grads = torch.autograd.grad((ref * g).sum(), (y, scale, bias))
    assert grads[0].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)


def _backward_of_a_bn_pass(how: str) -> torch.fx.GraphModule:
    """The backward graph that AOTAutograd's partitioner (inductor's, min-cut) makes for a BN's
    scale and bias computed from its sums and applied by an ``_AffineReLU`` pass: the tensors
    as they are ("plain"), or as ``affine_relu`` passes them (copies: "copy"; marked: "mark")."""
    from fasttrain.model.ops.conv_bn import _AffineReLU

    def bn_pass(y, total, total_sq, weight, bias):
        mean = total / 100
        scale = weight * torch.rsqrt(total_sq / 100 - mean * mean + 1e-5)
        shift = bias - mean * scale
        if how == "plain":
            return _AffineReLU.apply(y, scale, shift)
        return affine_relu(y, scale, shift, copy_affine=how == "copy")

    y = randn_nhwc(4, 6, 5, 5, dtype=torch.float32).requires_grad_()
    weight, bias = torch.rand(6, requires_grad=True), torch.rand(6, requires_grad=True)
    total, total_sq = torch.randn(6), torch.rand(6) * 10 + 50
    return partitioned_backward(bn_pass, y, total, total_sq, weight, bias)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plain", "copy", "mark"])
def test_the_bn_pass_backward_reads_the_saved_scale_and_bias(how):
    """Inductor's partitioner recomputes per-channel arithmetic in the backward rather than save
    it: the plain pass's backward rebuilds the scale and bias from the BN's inputs. Passed as
    ``kept``'s copies or marked ``stored`` (``copy_affine`` on and off), both are saved and read
    by the backward as two tensors that are neither the graph's inputs nor its gradients."""
    saved = [
        n.name
        for n in _backward_of_a_bn_pass(how).graph.find_nodes(op="placeholder")
        if not n.name.startswith(("primals_", "tangents_"))
    ]
    assert len(saved) == (0 if how == "plain" else 2), saved


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_residual_relu_is_relu_of_affine_plus_identity_forward_and_backward(compiled):
    """residual_relu stores its masked gradient (a no-op outside a compiled graph): the values
    and gradients of torch.relu(affine(...) + identity) for all four inputs, negative scales
    included, channels_last kept; compiled into one graph, the same."""
    y = randn_nhwc(4, 6, 5, 5).requires_grad_()
    identity = randn_nhwc(4, 6, 5, 5, seed=1).requires_grad_()
    scale = torch.linspace(-1.5, 2.0, 6, dtype=torch.float64).requires_grad_()
    bias = torch.linspace(-0.4, 0.6, 6, dtype=torch.float64).requires_grad_()
    g = randn_nhwc(4, 6, 5, 5, seed=3)
    fn = torch.compile(residual_relu, fullgraph=True) if compiled else residual_relu
    out, ref = fn(y, scale, bias, identity), torch.relu(affine(y, scale, bias) + identity)
    torch.testing.assert_close(out, ref)
    inputs = (y, scale, bias, identity)
    grads = torch.autograd.grad((out * g).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * g).sum(), inputs)
    assert grads[0].is_contiguous(memory_format=torch.channels_last)
    assert grads[3].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("channels_last", [True, False])
def test_packed_signs_hold_each_channel_in_its_bit_and_unpack_to_the_mask(channels_last):
    """Byte j of a pixel holds channels 8j..8j+7, channel 8j+i in bit i; unpacked, the bits are
    ``t > 0`` exactly (zeros and negative zeros count as not positive), in channels_last."""
    t = torch.zeros(2, 16, 3, 4)
    t[1, 3, 2, 1] = 1.0  # byte 0, bit 3
    t[1, 15, 2, 1] = 2.0  # byte 1, bit 7
    t[0, 8, 0, 0] = -0.0
    signs = pack_signs(t)
    assert signs.shape == (2, 3, 4, 2) and signs.dtype == torch.uint8
    assert signs[1, 2, 1].tolist() == [8, 128] and int(signs.sum()) == 136
    x = torch.randn(3, 24, 5, 7, generator=torch.Generator().manual_seed(0))
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    unpacked = unpack_signs(pack_signs(x), x.shape)
    assert unpacked.dtype == torch.bool
    assert unpacked.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(unpacked, x > 0)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_residual_relu_with_a_packed_mask_has_the_same_values_and_gradients(compiled):
    """``packed_mask`` keeps the ReLU's mask as bits for the backward: the same output and
    gradients for all four inputs as torch.relu(affine(...) + identity), compiled too; with
    channels that are no multiple of 8 it falls back to the unpacked mask."""
    for c in (16, 6):
        y = randn_nhwc(2, c, 5, 5).requires_grad_()
        identity = randn_nhwc(2, c, 5, 5, seed=1).requires_grad_()
        scale = torch.linspace(-1.5, 2.0, c, dtype=torch.float64).requires_grad_()
        bias = torch.linspace(-0.4, 0.6, c, dtype=torch.float64).requires_grad_()
        g = randn_nhwc(2, c, 5, 5, seed=3)

        def packed(y, scale, bias, identity):
            return residual_relu(y, scale, bias, identity, packed_mask=True)

        fn = torch.compile(packed, fullgraph=True) if compiled else packed
        out, ref = fn(y, scale, bias, identity), torch.relu(affine(y, scale, bias) + identity)
        torch.testing.assert_close(out, ref)
        assert out.is_contiguous(memory_format=torch.channels_last)  # cuDNN's fused conv's input
        inputs = (y, scale, bias, identity)
        grads = torch.autograd.grad((out * g).sum(), inputs)
        ref_grads = torch.autograd.grad((ref * g).sum(), inputs)
        assert grads[0].is_contiguous(memory_format=torch.channels_last)
        assert grads[3].is_contiguous(memory_format=torch.channels_last)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b)


def test_relu_and_signs_is_relu_and_the_packed_signs_nan_included():
    """The block end's forward: torch.relu's output (NaN kept, channels_last) and
    ``pack_signs`` of its input."""
    z = torch.randn(2, 16, 3, 5, generator=torch.Generator().manual_seed(0))
    z = z.contiguous(memory_format=torch.channels_last)
    z[0, 3, 1, 1], z[1, 9, 0, 4] = float("nan"), -0.0
    out, signs = relu_and_signs(z)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, torch.relu(z), equal_nan=True)
    assert torch.equal(signs, pack_signs(z))


def test_stored_is_the_tensor_itself_outside_a_compiled_graph():
    """``stored`` relies on inductor's stride prim: if a torch release drops or changes it, this
    fails rather than the compiled step."""
    t = randn_nhwc(2, 4, 3, 3)
    assert stored(t) is t


@pytest.mark.slow
def test_the_compiled_chain_matches_eager_forward_and_backward_in_one_graph():
    """inductor traces the forward and the autograd formula (``conv_bn.backward``, torch ops)
    into one graph (fullgraph: a break fails) and computes what eager does, gradients and
    running statistics included."""
    torch.manual_seed(0)
    mods = [
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.Conv2d(8, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
    ]
    for bn in mods[1::2]:
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.5, 0.5)
    eager = [m.to(memory_format=torch.channels_last) for m in mods]
    compiled_mods = copy.deepcopy(eager)
    chain = torch.compile(_fused_chain, fullgraph=True)
    x = randn_nhwc(4, 3, 8, 8, dtype=torch.float32)
    g = randn_nhwc(4, 6, 8, 8, seed=7, dtype=torch.float32)
    out_e, out_c = _fused_chain(*eager, x), chain(*compiled_mods, x)
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-4)
    params_e = [p for m in eager for p in m.parameters()]
    params_c = [p for m in compiled_mods for p in m.parameters()]
    grads_e = torch.autograd.grad((out_e * g).sum(), params_e)
    grads_c = torch.autograd.grad((out_c * g).sum(), params_c)
    for a, b in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    for bn_c, bn_e in zip(compiled_mods[1::2], eager[1::2], strict=True):
        torch.testing.assert_close(bn_c.running_var, bn_e.running_var)


# (channels in, out, kernel, stride, padding, input size, prologue): ResNet-50's kinds of
# convolution, with and without the previous BN folded in
GPU_SHAPES = [
    (64, 64, 3, 1, 1, 56, True),
    (64, 64, 1, 1, 0, 56, False),
    (64, 256, 1, 1, 0, 56, True),
    (128, 128, 3, 2, 1, 56, True),
    (256, 512, 1, 2, 0, 56, False),
    (3, 64, 7, 2, 3, 224, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c, k, r, stride, padding, size, prologue", GPU_SHAPES)
def test_cudnn_conv_bn_matches_the_reference_in_fp16(
    c, k, r, stride, padding, size, prologue, cudnn_frontend
):
    """cuDNN's fused forward against the reference, where it runs: every ResNet-50 kind of
    convolution on an H200 with cuDNN 9.19, the prologue included, and not the stem's 3-channel
    one, where the custom op falls back to the reference exactly; the op also replays from a
    CUDA graph with new inputs."""
    from fasttrain.model.cudnn import conv_bn as cudnn_conv_bn
    from fasttrain.model.ops.conv_bn import reference

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(32, c, size, size, device=dev, generator=g).half()
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(k, c, r, r, device=dev, generator=g) * (2 / (c * r * r)) ** 0.5
    w = w.contiguous(memory_format=torch.channels_last)
    scale = torch.rand(c, device=dev, generator=g) + 0.5 if prologue else None
    bias = torch.randn(c, device=dev, generator=g) * 0.2 if prologue else None
    want = reference(x, w, scale, bias, stride, padding)
    # cuDNN takes the prologue's scale and bias in fp16: its output is the reference's on the
    # rounded vectors (each channel's sum is a small difference of large terms, so the rounding
    # moves it by percents, while every output stays within fp16 precision of the fp32 one)
    rounded = [v.half().float() if v is not None else None for v in (scale, bias)]
    want16 = reference(x, w, *rounded, stride, padding)
    got = cudnn_conv_bn.forward(x, w, scale, bias, stride, padding)
    expected = c % 8 == 0  # cuDNN 9.19 on an H200 runs all but the 3-channel stem
    assert (got is not None) == expected, "cuDNN ran it" if got is not None else "declined"
    assert cudnn_conv_bn.supported(tuple(x.shape), tuple(w.shape), stride, padding, prologue,
                                   dev) == expected  # the start-up probe agrees  # fmt: skip
    op = conv_bn(x, w, scale, bias, stride, padding)
    if not expected:  # the fallback is the reference itself
        for a, b in zip(op, want, strict=True):
            assert torch.equal(a, b)
    # the op is cuDNN's result where cuDNN runs, else the reference on the vectors as given
    for out, exact in [(got, want16), (op, want16)] if expected else []:
        y, total, total_sq = out
        assert y.shape == want[0].shape and y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y.float(), want[0].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y.float(), exact[0].float(), rtol=2e-3, atol=4e-3)
        torch.testing.assert_close(total, exact[1], rtol=2e-3, atol=1.0)
        torch.testing.assert_close(total_sq, exact[2], rtol=2e-3, atol=1.0)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    conv_bn(static, w, scale, bias, stride, padding)  # plans are built outside the capture
    with torch.cuda.graph(graph):
        captured = conv_bn(static, w, scale, bias, stride, padding)
    static.copy_(torch.flip(x, dims=[0]))
    graph.replay()
    again = conv_bn(static, w, scale, bias, stride, padding)
    torch.testing.assert_close(captured[0], again[0])
    for a, b in zip(captured[1:], again[1:], strict=True):  # cuDNN's sums: atomics, any order
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-2)
