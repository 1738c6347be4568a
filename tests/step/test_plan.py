"""The run's epochs as steps (``plan.Plan``) and the LR schedule over epochs that differ in steps
and global batch (``optim.plan_schedule``)."""

import pytest
import torch

from fasttrain.config import OptimConfig
from fasttrain.step.optim import build_schedule, plan_schedule
from fasttrain.step.plan import Plan

# 4 epochs: two at a small size (global batch 1024, 10 steps), two at the full size (512, 20)
MIXED = Plan((10, 10, 20, 20), (1024, 1024, 512, 512))


def test_a_plan_locates_every_step_in_its_epoch():
    assert MIXED.starts == (0, 10, 20, 40, 60) and MIXED.total_steps == 60
    assert [MIXED.locate(s) for s in (0, 9, 10, 19, 20, 39, 40, 59, 60)] == [
        (0, 0), (0, 9), (1, 0), (1, 9), (2, 0), (2, 19), (3, 0), (3, 19), (4, 0),
    ]  # fmt: skip
    assert not MIXED.is_uniform and Plan.uniform(7, 256, 3).is_uniform
    assert Plan.uniform(7, 256, 3).locate(15) == divmod(15, 7)
    assert Plan.from_state_dict(MIXED.state_dict()) == MIXED
    assert MIXED.describe() == (
        "epochs 0-1: global batch 1024, 10 steps each; epochs 2-3: global batch 512, 20 steps each"
    )


@pytest.mark.parametrize("kind", ["step", "cosine", "poly"])
def test_a_uniform_plan_gives_the_uniform_schedule(kind):
    cfg = OptimConfig(lr=0.1, warmup_epochs=1.5, lr_schedule=kind, lr_step_epochs=2)
    assert plan_schedule(cfg, Plan.uniform(10, 1024, 6)) == build_schedule(cfg, 1024, 10, 6)


def test_each_epoch_peaks_at_its_own_global_batchs_lr():
    cfg = OptimConfig(lr=0.1, warmup_epochs=0, lr_schedule="step", lr_step_epochs=100)
    s = plan_schedule(cfg, MIXED)
    assert [s.lr_at(i) for i in (0, 19, 20, 59)] == pytest.approx([0.4, 0.4, 0.2, 0.2])
    flat = plan_schedule(OptimConfig(lr=0.1, warmup_epochs=0, lr_scaling="none"), MIXED)
    assert flat.lr_at(0) == flat.lr_at(20) == pytest.approx(0.1)


def test_warmup_and_step_decays_follow_the_epochs_not_a_fixed_step_count():
    cfg = OptimConfig(lr=0.1, warmup_epochs=2.5, lr_schedule="step", lr_step_epochs=3, lr_gamma=0.1)
    s = plan_schedule(cfg, MIXED)
    assert s.warmup_steps == 10 + 10 + 10  # two epochs of 10 steps, half of one of 20
    assert s.lr_at(29) == pytest.approx(0.2)  # the warm-up's last step, at epoch 2's peak
    assert s.lr_at(39) == pytest.approx(0.2) and s.lr_at(40) == pytest.approx(0.02)  # epoch 3


@pytest.mark.parametrize("kind", ["step", "cosine", "poly"])
def test_the_device_schedule_equals_the_host_one_at_every_step(kind):
    cfg = OptimConfig(lr=0.1, warmup_epochs=1.5, lr_schedule=kind, lr_step_epochs=2)
    s = plan_schedule(cfg, MIXED)
    host = [s.lr_at(i) for i in range(MIXED.total_steps + 1)]
    device = [float(s.lr_tensor(torch.tensor(i))) for i in range(MIXED.total_steps + 1)]
    assert device == pytest.approx(host, rel=1e-6, abs=1e-9)
    assert len(set(host)) >= 15  # it moves
