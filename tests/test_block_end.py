"""The block end's backward in one Triton kernel (kernels/block_end.py; interpreted on the CPU):
the kernel against its torch reference, ``residual_relu_twice`` against torch.relu(affine(...) +
identity), and the fused ResNet built on it against torchvision's, eager and compiled."""

import copy

import pytest
import torch
from fasttrain.kernels import block_end
from fasttrain.kernels.block_end import masked_sums, masked_sums_reference

from fasttrain.conv_bn import affine, residual_relu_twice
from fasttrain.fused_resnet import FusedResNet
from tests.conftest import assert_matches_torchvision, randn_nhwc

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("two", [True, False], ids=["two parts", "one part"])
@pytest.mark.parametrize("shape", [(3, 70, 5, 7), (2, 8, 40, 41)], ids=["channels", "rows"])
def test_masked_sums_matches_torch(dtype, two, shape):
    """The masked gradient exactly (the two parts added in their dtype, as torch's add rounds),
    channels_last; its per-channel sums and those of it times y, in fp32 (fp64 for fp64), to
    within the order of additions. Shapes past one 64-channel tile, and with many programs
    over rows (and a partial last tile) in each."""
    parts = [randn_nhwc(*shape, seed=s, dtype=dtype).to(DEV) for s in range(4)]
    g1, g2, out, y = parts
    out = out.relu()
    out[0, :, 0, :2] = 0  # exact zeros: the ReLU's gradient is zero there, as torch's
    got = masked_sums(g1, g2 if two else None, out, y)
    want = masked_sums_reference(g1, g2 if two else None, out, y)
    assert got[0].dtype == dtype and got[0].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a.dtype == b.dtype == torch.promote_types(dtype, torch.float32)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_masked_sums_is_a_well_formed_custom_op():
    """Schema and fake (meta) implementation: torch.library's own checks."""
    g1, g2, out, y = (randn_nhwc(2, 4, 3, 3, seed=s, dtype=torch.float32) for s in range(4))
    torch.library.opcheck(
        masked_sums, (g1, g2, out.relu(), y), test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("readers", [2, 1], ids=["both outputs read", "the first read"])
def test_residual_relu_twice_is_relu_of_affine_plus_identity(compiled, readers):
    """Both outputs hold relu(affine(y) + identity); the gradients of y, scale, bias and identity
    are torch's, with the gradients of the two outputs added (both read, as by the next block)
    or of the first alone (the second unread); compiled into one graph, the same."""
    y = randn_nhwc(4, 6, 5, 5).requires_grad_()
    identity = randn_nhwc(4, 6, 5, 5, seed=1).requires_grad_()
    scale = torch.linspace(-1.5, 2.0, 6, dtype=torch.float64).requires_grad_()
    bias = torch.linspace(-0.4, 0.6, 6, dtype=torch.float64).requires_grad_()
    g1, g2 = randn_nhwc(4, 6, 5, 5, seed=3), randn_nhwc(4, 6, 5, 5, seed=4)

    def loss(fn):
        out, twin = fn(y, scale, bias, identity)
        return (out * g1).sum() + ((twin * g2).sum() if readers == 2 else 0), out, twin

    fn = torch.compile(residual_relu_twice, fullgraph=True) if compiled else residual_relu_twice
    total, out, twin = loss(fn)
    ref = torch.relu(affine(y, scale, bias) + identity)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(twin, ref)
    inputs = (y, scale, bias, identity)
    grads = torch.autograd.grad(total, inputs)
    ref_total = (ref * g1).sum() + ((ref * g2).sum() if readers == 2 else 0)
    for a, b in zip(grads, torch.autograd.grad(ref_total, inputs), strict=True):
        torch.testing.assert_close(a, b)
    assert grads[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_the_block_end_kernel_keeps_torchvisions_model(arch):
    """FusedResNet(block_end_kernel=True): torchvision's weights, state dict, logits, gradients
    and running statistics (fp64)."""
    assert_matches_torchvision(
        arch, lambda arch, **kw: FusedResNet(arch, block_end_kernel=True, **kw)
    )


@pytest.mark.slow
def test_the_block_end_kernel_compiles_into_one_graph(monkeypatch):
    """Compiled with fullgraph=True, the model with the kernel gives the logits and gradients
    of the same model in eager mode, and runs the kernel at every block end but the last
    (whose output only the pool reads), each with the two gradient parts."""
    launches = []
    kernel = block_end._masked_sums

    class Counted:  # the Triton kernel, each launch's HAS_G2 noted
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["HAS_G2"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(block_end, "_masked_sums", Counted())
    torch.manual_seed(0)
    ours = FusedResNet("resnet18", num_classes=5, block_end_kernel=True)
    ours = ours.to(DEV, memory_format=torch.channels_last)
    ref = copy.deepcopy(ours)
    x = randn_nhwc(4, 3, 64, 64, seed=1, dtype=torch.float32).to(DEV)
    out = torch.compile(ours, fullgraph=True)(x)
    out.sum().backward()
    assert launches == [True] * 7  # resnet18: 8 blocks
    out_ref = ref(x)
    out_ref.sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
