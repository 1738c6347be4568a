"""The stem's BN + ReLU + max-pool in fasttrain's Triton pool (``fasttrain.bn_pool``) against
plain torch: the normalise + ReLU inside the pool, and the whole BN inside it with its one-pass
backward, against ``nn.BatchNorm2d`` (running statistics included). The kernels run on the GPU
where there is one, else in Triton's interpreter (``TRITON_INTERPRET=1``, conftest.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.model.ops.bn_pool import affine_relu_max_pool2d, bn_relu_max_pool2d
from fasttrain.model.ops.conv_bn import affine, bn_finalize, bn_finalize_backward, sums

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_affine_relu_maxpool_matches_torch(dtype):
    """The stem's BN normalise + ReLU applied inside the Triton max-pool: the values of
    max_pool2d(relu(affine(y))), negative scales and zero windows included, exactly in fp16
    (each normalised value rounded to y's dtype before the max, as torch stores it) and in fp32
    to within the rounding of the affine (a GPU fuses its multiply-add, torch's eager ops round
    the product first), and the gradients of y, scale and bias (the pool's gather, then the
    mask by the recomputed pre-activation)."""
    g = torch.Generator().manual_seed(7)
    y = torch.randn(2, 70, 9, 7, generator=g).to(dtype)  # past one 64-wide channel tile
    y = y.to(memory_format=torch.channels_last).to(DEV)
    scale = torch.linspace(-1.5, 2.0, 70, device=DEV)
    bias = torch.linspace(-0.4, 0.6, 70, device=DEV)
    ours = [t.clone().requires_grad_() for t in (y, scale, bias)]
    ref = [t.clone().requires_grad_() for t in (y, scale, bias)]
    out = affine_relu_max_pool2d(*ours, 3, 2, 1)
    out_ref = F.max_pool2d(torch.relu(affine(*ref)), 3, 2, 1)
    assert out.dtype == dtype and out.stride() == out_ref.stride()
    exact = 0 if dtype == torch.float16 else 1e-6
    torch.testing.assert_close(out, out_ref, rtol=exact, atol=exact)
    grad = torch.randn(out.shape, generator=g).to(dtype).to(DEV)
    out.backward(grad)
    out_ref.backward(grad)
    assert ours[0].grad.stride() == ref[0].grad.stride()
    tol = 1e-5 if dtype == torch.float32 else 4e-3  # torch's fp16 backward sums in fp16
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "total, total_sq",
    [
        (torch.tensor([3.0, -1.5, 0.25]), torch.tensor([5.0, 2.0, 0.5])),
        # the middle channel's variance comes out below 0 and is clamped
        (torch.tensor([2.0, 1.0, -3.0]), torch.tensor([1.5, 0.1, 2.5])),
        # the middle channel's variance is exactly 0 (a constant channel: 4 values of 0.5), where
        # clamp_min's gradient differs between torch versions and ``at_least_zero``'s does not
        (torch.tensor([2.0, 2.0, -3.0]), torch.tensor([1.5, 1.0, 2.5])),
    ],
)
def test_bn_finalize_backward_is_autograds_gradient_of_bn_finalize(total, total_sq):
    """The statistics' gradients ``bn_finalize_backward`` computes by formula are those autograd
    takes through ``bn_finalize`` (fp64), where the variance is clamped up to 0 too."""
    bn = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.5, -0.7, 0.9]))
    total, total_sq = (t.double().requires_grad_() for t in (total, total_sq))
    scale, bias = bn_finalize(total, total_sq, 4, bn)
    grad_scale, grad_bias = torch.tensor([0.3, -1.2, 2.0]).double(), torch.tensor([-0.4, 0.8, 1.1])
    want = torch.autograd.grad((scale, bias), (total, total_sq), (grad_scale, grad_bias.double()))
    got = bn_finalize_backward(
        grad_scale, grad_bias.double(), total.detach(), total_sq.detach(), 4, scale.detach(), bn.eps
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _stem_inputs(dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, nn.BatchNorm2d]:
    """A stem's convolution output (2 x 70 x 13 x 11, channels_last: past one 64-wide channel
    tile, odd sizes) and its BN, with negative and zero scales among its weights."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(2, 70, 13, 11, generator=g) * 2 + 0.5).to(dtype)
    y = y.to(memory_format=torch.channels_last).to(DEV)
    bn = nn.BatchNorm2d(70, momentum=0.2)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(-1.5, 2.0, 70))
        bn.weight[5] = 0.0
        bn.bias.copy_(torch.linspace(-0.4, 0.6, 70))
    return y, bn.to(DEV)


def _pooled(y: torch.Tensor, bn: nn.BatchNorm2d, fused: bool) -> torch.Tensor:
    if fused:
        return bn_relu_max_pool2d(y, bn, 3, 2, 1)
    return F.max_pool2d(torch.relu(bn(y)), 3, 2, 1)


def test_bn_relu_max_pool2d_matches_batchnorm_relu_maxpool():
    """The whole stem BN inside the pool (fp32) against ``nn.BatchNorm2d`` + ReLU +
    ``F.max_pool2d``: the output, the gradients of the input, the BN's weight and bias (the
    statistics' share of the input's included: its one-pass backward) and the running
    statistics, over two steps."""
    y, bn = _stem_inputs(torch.float32)
    ours, ref = [y.clone().requires_grad_() for _ in range(2)]
    bn_ref = copy.deepcopy(bn)
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        out, want = _pooled(ours, bn, True), _pooled(ref, bn_ref, False)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        grad = torch.randn(out.shape, generator=g).to(DEV)
        out.backward(grad)
        want.backward(grad)
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-4, atol=1e-5)
    assert ours.grad.stride() == ref.grad.stride()
    for a, b in [(bn.weight.grad, bn_ref.weight.grad), (bn.bias.grad, bn_ref.bias.grad)]:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(bn, name), getattr(bn_ref, name))


def test_bn_relu_max_pool2d_in_fp16_is_the_fp32_batchnorm_to_one_rounding():
    """In fp16: the output exactly that of the path it replaces (the sums, ``bn_finalize``, then
    ``affine_relu_max_pool2d``), and the gradients those of ``nn.BatchNorm2d`` + ReLU + pool in
    fp32 on the same input, the input's to one fp16 rounding. (The path it replaces rounds the
    pool's gradient to fp16 before its BN sums, 0.5% off the weight's gradient here; these sums
    take the pool's gradient as it comes, over the pooled side.)"""
    y, bn = _stem_inputs(torch.float16)
    ours, truth = y.clone().requires_grad_(), y.float().requires_grad_()
    bn_old, bn_truth = copy.deepcopy(bn), copy.deepcopy(bn)
    out = bn_relu_max_pool2d(ours, bn, 3, 2, 1)
    count = y.shape[0] * y.shape[2] * y.shape[3]
    old = affine_relu_max_pool2d(y, *bn_finalize(*sums(y), count, bn_old), 3, 2, 1)
    torch.testing.assert_close(out, old, rtol=0, atol=0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).half().to(DEV)
    out.backward(grad)
    _pooled(truth, bn_truth, False).backward(grad.float())
    torch.testing.assert_close(ours.grad.float(), truth.grad, rtol=1e-3, atol=1e-3)
    for a, b in [(bn.weight.grad, bn_truth.weight.grad), (bn.bias.grad, bn_truth.bias.grad)]:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(bn.running_var, bn_old.running_var)


def test_bn_relu_max_pool2d_asks_for_a_training_bn():
    y, bn = _stem_inputs(torch.float32)
    with pytest.raises(ValueError, match="training"):
        bn_relu_max_pool2d(y, bn.eval(), 3, 2, 1)
