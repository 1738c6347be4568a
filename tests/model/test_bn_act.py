"""The ``--cudnn-bn`` path's op and model against plain torch: ``bn_act`` against
``nn.BatchNorm2d`` (+ add) (+ ReLU), forward and backward, running statistics included; the mask
bits; ``BNActResNet`` against torchvision's ResNet with the same state dict; on a GPU, cuDNN's
kernels against the reference."""

import pytest
import torch
from torch import nn

from fasttrain.model.bn_act_resnet import BNActResNet
from fasttrain.model.ops.bn_act import (
    batch_norm_act,
    bn_act,
    bn_act_backward,
    pack_mask,
    unpack_mask,
)
from tests.conftest import assert_matches_torchvision


def _x(*shape, seed=0, dtype=torch.float64, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype, device=device).contiguous(
        memory_format=torch.channels_last
    )


def test_the_mask_packs_channel_c_into_bit_c_mod_8_of_byte_c_div_8():
    positive = torch.zeros(1, 12, 1, 2, dtype=torch.bool)
    positive[0, 0, 0, 0] = positive[0, 9, 0, 0] = positive[0, 11, 0, 1] = True
    packed = pack_mask(positive)
    assert packed.shape == (1, 2, 1, 2) and packed.dtype == torch.uint8
    assert packed.is_contiguous(memory_format=torch.channels_last)
    assert packed[0, :, 0, 0].tolist() == [0b1, 0b10] and packed[0, :, 0, 1].tolist() == [0, 0b1000]
    random = _x(3, 20, 4, 5, seed=1) > 0
    assert torch.equal(unpack_mask(pack_mask(random), 20), random)


@pytest.mark.parametrize("residual, relu", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_act_matches_batchnorm2d_add_relu(residual, relu, momentum):
    """Two training steps then eval mode (fp64): outputs, the gradients of input, residual, weight
    and bias, and the running statistics (momentum, unbiased variance, the batch count)."""
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(6, momentum=momentum).double()
    nn.init.uniform_(ref.weight, 0.5, 1.5)
    nn.init.uniform_(ref.bias, -0.5, 0.5)
    ours = nn.BatchNorm2d(6, momentum=momentum).double()
    ours.load_state_dict(ref.state_dict())

    def plain(x, z):
        y = ref(x) + (z if z is not None else 0)
        return torch.relu(y) if relu else y

    for step in range(2):
        x = _x(4, 6, 5, 5, seed=step).requires_grad_()
        z = _x(4, 6, 5, 5, seed=10 + step).requires_grad_() if residual else None
        g = _x(4, 6, 5, 5, seed=20 + step)
        out, want = batch_norm_act(x, ours, z, relu), plain(x, z)
        torch.testing.assert_close(out, want)
        assert out.is_contiguous(memory_format=torch.channels_last)
        inputs = [x, *([z] if residual else [])]
        got = torch.autograd.grad((out * g).sum(), [*inputs, ours.weight, ours.bias])
        exp = torch.autograd.grad((want * g).sum(), [*inputs, ref.weight, ref.bias])
        for a, b in zip(got, exp, strict=True):
            torch.testing.assert_close(a, b)
    for name, buffer in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[name], buffer, msg=name)
    ours.eval()
    ref.eval()
    x = _x(4, 6, 5, 5, seed=99)
    z = _x(4, 6, 5, 5, seed=98) if residual else None
    torch.testing.assert_close(batch_norm_act(x, ours, z, relu), plain(x, z))


def test_bn_act_ops_are_well_formed_custom_ops():
    """Schema, fake (meta) implementations, autograd registration: torch.library's own checks."""
    x = _x(2, 16, 4, 4, dtype=torch.float32).requires_grad_()
    z = _x(2, 16, 4, 4, seed=1, dtype=torch.float32).requires_grad_()
    w, b = (torch.rand(16) + 0.5).requires_grad_(), torch.randn(16).requires_grad_()
    torch.library.opcheck(bn_act, (x, w, b, z, 1e-5, True))
    torch.library.opcheck(bn_act, (x, w, b, None, 1e-5, False))
    with torch.no_grad():  # the backward op is the formula itself: it has none of its own
        _, mask, mean, invstd = bn_act(x, w, b, z, 1e-5, True)
    grad = _x(2, 16, 4, 4, seed=2, dtype=torch.float32)
    args = (grad, x.detach(), mask, w.detach(), mean, invstd)
    torch.library.opcheck(bn_act_backward, (*args, True, True))


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_bn_act_resnet_is_torchvisions_model(arch):
    """The same weights, state dict, logits, gradients and running statistics as torchvision's
    ResNet."""
    assert_matches_torchvision(arch, BNActResNet)


def test_the_bn_act_forward_traces_without_graph_breaks():
    model = BNActResNet("resnet18", num_classes=4).to(memory_format=torch.channels_last)
    explained = torch._dynamo.explain(model)(_x(2, 3, 32, 32, dtype=torch.float32))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


# ResNet-50's BN shapes at batch 32 (channels, size), each with and without the residual add
GPU_SHAPES = [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (1024, 14), (2048, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("c, size", GPU_SHAPES)
def test_cudnn_bn_matches_the_reference(c, size, dtype, cudnn_frontend):
    """cuDNN's BN + add + ReLU forward (output, mask, statistics) and dReLU + dAdd + dBN
    backward against the references, for each pattern the model uses; cuDNN must run them all
    (an H200 with cuDNN 9.19 does: BENCHMARKS.md); the op replays from a CUDA graph."""
    from fasttrain.model.cudnn import bn as cudnn_bn
    from fasttrain.model.ops import bn_act as ops

    dev = "cuda"
    x = (_x(32, c, size, size, dtype=torch.float32, device=dev) * 2 + 0.5).to(dtype)
    z = _x(32, c, size, size, seed=1, dtype=torch.float32, device=dev).to(dtype)
    dy = _x(32, c, size, size, seed=2, dtype=torch.float32, device=dev).to(dtype)
    w = torch.rand(c, device=dev) + 0.5
    b = torch.randn(c, device=dev) * 0.2
    for residual, relu in [(None, True), (z, True), (None, False)]:
        got = cudnn_bn.forward(x, w, b, residual, 1e-5, relu)
        assert got is not None, (c, size, dtype, residual is not None, relu)
        want = ops.reference(x, w, b, residual, 1e-5, relu)
        y, mask, mean, invstd = got
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(mean, want[2], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(invstd, want[3], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y.float(), want[0].float(), rtol=2e-2, atol=2e-2)
        if relu:  # away from zero, where rounding may flip a bit, the masks agree
            clear = want[0].float().abs() > 0.05
            mine, theirs = unpack_mask(mask, c), unpack_mask(want[1], c)
            assert torch.equal(mine[clear], theirs[clear])
        grads = cudnn_bn.backward(dy, x, want[1], w, want[2], want[3], relu, residual is not None)
        assert grads is not None
        expect = ops.backward_reference(
            dy, x, want[1], w, want[2], want[3], relu, residual is not None
        )
        torch.testing.assert_close(grads[0].float(), expect[0].float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(grads[1], expect[1], rtol=1e-2, atol=0.5)
        torch.testing.assert_close(grads[2], expect[2], rtol=1e-2, atol=0.5)
        if residual is not None:
            torch.testing.assert_close(grads[3].float(), expect[3].float())
    # the gradient from the average pool's backward reaches the last BN contiguous, not NHWC
    nchw = cudnn_bn.backward(dy.contiguous(), x, want[1], w, want[2], want[3], False, False)
    assert nchw is not None
    torch.testing.assert_close(nchw[0].float(), grads[0].float(), rtol=1e-2, atol=1e-2)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    bn_act(static, w, b, z, 1e-5, True)  # plans are built outside the capture
    with torch.cuda.graph(graph):
        captured = bn_act(static, w, b, z, 1e-5, True)
    static.copy_(torch.flip(x, dims=[0]))
    graph.replay()
    again = bn_act(static, w, b, z, 1e-5, True)
    torch.testing.assert_close(captured[0], again[0])
