import copy
import itertools
import math

import pytest
import torch
from torch import nn

from fasttrain.config import OptimConfig
from fasttrain.model.build import build_model, param_groups
from fasttrain.step.optim import build_optimizer, build_schedule, set_lr


def schedule(**kw):
    cfg = OptimConfig(**{"lr": 0.1, "warmup_epochs": 2, **kw})
    return build_schedule(cfg, global_batch=1024, steps_per_epoch=10, epochs=90)


def test_lr_scales_linearly_with_the_global_batch():
    assert schedule(warmup_epochs=0).peak_lr == pytest.approx(0.4)


def test_linear_warmup_per_step():
    s = schedule()
    assert [s.lr_at(i) for i in (0, 9, 19)] == pytest.approx([0.02, 0.2, 0.4])


def test_step_decay_every_n_epochs():
    s = schedule(lr_schedule="step", lr_step_epochs=30, lr_gamma=0.1)
    assert s.lr_at(299) == pytest.approx(0.4)
    assert s.lr_at(300) == pytest.approx(0.04)
    assert s.lr_at(600) == pytest.approx(0.004)


def test_cosine_decays_to_zero_over_all_epochs():
    s = schedule(lr_schedule="cosine")
    assert s.lr_at(20) == pytest.approx(0.4)
    mid = 20 + (900 - 20) // 2
    assert s.lr_at(mid) == pytest.approx(0.2, rel=1e-2)
    assert s.lr_at(899) < 1e-5 and s.lr_at(899) >= 0
    lrs = [s.lr_at(i) for i in range(20, 900)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert not any(math.isnan(x) for x in lrs)


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_poly_decays_as_a_power_of_what_is_left(power):
    s = schedule(lr_schedule="poly", lr_power=power)
    assert s.lr_at(20) == pytest.approx(0.4)
    left = lambda step: 1 - (step - 20) / (900 - 20)  # noqa: E731
    for step in (100, 460, 800):
        assert s.lr_at(step) == pytest.approx(0.4 * left(step) ** power)
    assert s.lr_at(900) == 0.0


def test_bn_parameters_can_be_exempt_from_weight_decay():
    model = build_model("resnet18", 10, channels_last=False, device=torch.device("cpu"))
    groups = param_groups(model, 1e-4, bn_weight_decay=False)
    decayed, exempt = groups
    bn_params = {
        id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()
    }
    assert {id(p) for p in exempt["params"]} == bn_params and exempt["weight_decay"] == 0.0
    assert decayed["weight_decay"] == 1e-4
    assert len(decayed["params"]) + len(exempt["params"]) == len(list(model.parameters()))
    single = param_groups(model, 1e-4, bn_weight_decay=True)
    assert len(single) == 1 and len(single[0]["params"]) == len(list(model.parameters()))


def test_channels_last_model():
    model = build_model("resnet18", 10, channels_last=True, device=torch.device("cpu"))
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)


def test_zero_init_residual_starts_blocks_as_identity():
    on = build_model("resnet50", 10, False, torch.device("cpu"), zero_init_residual=True)
    off = build_model("resnet50", 10, False, torch.device("cpu"))
    for block in on.layer1:
        assert torch.count_nonzero(block.bn3.weight) == 0
    assert torch.count_nonzero(off.layer1[0].bn3.weight) > 0


@pytest.mark.parametrize("kind", ["step", "cosine", "poly"])
@pytest.mark.parametrize("warmup", [0, 2.5])
def test_device_lr_matches_the_host_schedule_at_every_step(kind, warmup):
    """The graphed step computes the LR on the device: it must be the host schedule's."""
    s = schedule(lr_schedule=kind, warmup_epochs=warmup, lr_step_epochs=3)
    steps = torch.arange(0, 905)
    got = torch.stack([s.lr_tensor(t) for t in steps])
    want = torch.tensor([s.lr_at(int(t)) for t in steps])
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-9)
    if kind == "step":  # the decays happened: 0.4 -> 0.04 -> ...
        assert got[35] == pytest.approx(0.04) and got[65] == pytest.approx(0.004)


def test_fused_sgd_with_a_tensor_lr_matches_foreach_sgd():
    """build_optimizer's fused SGD, reading its LR from a tensor, takes the reference's steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    cfg = OptimConfig(bn_weight_decay=False)
    fused = build_optimizer(model, cfg, 0.1)
    lr = torch.tensor(0.1)
    set_lr(fused, lr)
    groups = param_groups(ref, cfg.weight_decay, cfg.bn_weight_decay)
    foreach = torch.optim.SGD(groups, lr=0.1, momentum=cfg.momentum, foreach=True)
    assert fused.defaults["fused"] and len(fused.param_groups) == 2
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    start = model[0].weight.detach().clone()
    for i in range(5):
        lr.fill_(0.1 / (i + 1))
        set_lr(foreach, 0.1 / (i + 1))
        for m, opt in ((model, fused), (ref, foreach)):
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert (model[0].weight - start).abs().max() > 1e-3  # the steps did move the weights


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clip_grad_norm_clips_the_total_norm_before_the_update(max_norm):
    """The step's --clip-grad-norm against torch's clip_grad_norm_ written out by hand (and a
    bound too large to clip, which must change nothing)."""
    from fasttrain.metrics.meter import DeviceMeter
    from fasttrain.step.step import build_step
    from tests.conftest import constant_lr

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = build_step(model=model, optimizer=opt, criterion=nn.CrossEntropyLoss(),
                      amp_dtype=None, scaler=None, schedule=constant_lr(0.5), compile=False,
                      clip_grad_norm=max_norm)  # fmt: skip
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    step([(x, y)], DeviceMeter(torch.device("cpu")), 0)
    nn.functional.cross_entropy(ref(x), y).backward()
    grads = [p.grad for p in ref.parameters()]
    total = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    if max_norm == 0.05:
        assert scale < 0.5  # the bound is active
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * scale * p.grad
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
