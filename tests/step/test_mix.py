"""Mixup and CutMix (fasttrain.mix) against torchvision's v2.MixUp / v2.CutMix on the same
draws, and their draws' distribution and switches."""

import pytest
import torch
from torchvision.transforms import v2

from fasttrain.errors import UserError
from fasttrain.step.mix import Draw, Mixer, apply

N, C, H, W, CLASSES = 6, 3, 12, 16, 5


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(N, C, H, W, generator=g).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, CLASSES, (N,), generator=g)


def draw(lam, cx=0, cy=0, cutmix=False, mix=True) -> Draw:
    t = torch.tensor
    return Draw(t(lam), t(cx), t(cy), t(cutmix), t(mix))


@pytest.mark.parametrize("seed", range(4))
def test_mixup_is_torchvisions_on_the_same_draw(seed):
    images, labels = batch(seed)
    tv = v2.MixUp(alpha=0.8, num_classes=CLASSES)
    torch.manual_seed(seed)
    params = tv.make_params([images])
    torch.manual_seed(seed)
    want_x, want_y = tv(images, labels)
    got_x, got_y = apply(images, labels, draw(params["lam"]), CLASSES)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_y, want_y)
    assert got_x.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("seed", range(6))
def test_cutmix_is_torchvisions_on_the_same_draw(seed):
    """torchvision draws lam, then the centre's column and row; the same draws give the same
    box, the same pasted pixels and the same adjusted lam."""
    images, labels = batch(seed)
    tv = v2.CutMix(alpha=1.0, num_classes=CLASSES)
    torch.manual_seed(seed)
    lam = float(tv._dist.sample(()))
    cx, cy = int(torch.randint(W, (1,))), int(torch.randint(H, (1,)))
    torch.manual_seed(seed)
    want_x, want_y = tv(images, labels)
    got_x, got_y = apply(images, labels, draw(lam, cx, cy, cutmix=True), CLASSES)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_y, want_y)


def test_a_batch_drawn_not_to_mix_is_left_as_it_is():
    images, labels = batch()
    x, y = apply(images, labels, draw(0.3, 4, 4, cutmix=True, mix=False), CLASSES)
    assert torch.equal(x, images)
    torch.testing.assert_close(y, torch.nn.functional.one_hot(labels, CLASSES).float())


def test_the_draws_follow_the_flags():
    both = Mixer(CLASSES, mixup_alpha=0.2, cutmix_alpha=1.0, prob=0.5, switch_prob=0.25)
    draws = [both.draw(H, W) for _ in range(4000)]
    mixed = torch.stack([d.mix for d in draws]).float().mean()
    cut = torch.stack([d.cutmix for d in draws]).float().mean()
    assert abs(mixed - 0.5) < 0.03 and abs(cut - 0.25) < 0.03
    lam = torch.stack([d.lam for d in draws if not d.cutmix])  # Beta(0.2, 0.2): mean 1/2, U-shaped
    assert abs(lam.mean() - 0.5) < 0.03 and ((lam < 0.1) | (lam > 0.9)).float().mean() > 0.5
    assert all(0 <= int(d.cx) < W and 0 <= int(d.cy) < H for d in draws[:100])
    only_cut = Mixer(CLASSES, cutmix_alpha=1.0)
    assert all(bool(only_cut.draw(H, W).cutmix) for _ in range(20))
    # its own generator: the same seed, the same draws, whatever torch's global one did
    again = Mixer(CLASSES, mixup_alpha=0.2, cutmix_alpha=1.0, prob=0.5, switch_prob=0.25)
    torch.rand(100)
    assert torch.equal(again.draw(H, W).lam, draws[0].lam)
    with pytest.raises(ValueError, match="must be positive"):
        Mixer(CLASSES)


def test_soft_targets_train_through_torchs_cross_entropy_with_label_smoothing():
    """The loss of a mixed batch is lam times the first labels' plus (1 - lam) the rolled ones'
    (cross-entropy is linear in its target)."""
    images, labels = batch()
    logits = torch.randn(N, CLASSES)
    _, y = apply(images, labels, draw(0.7), CLASSES)
    ce = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    want = 0.7 * ce(logits, labels) + 0.3 * ce(logits, labels.roll(1, 0))
    torch.testing.assert_close(ce(logits, y), want)


def test_a_run_with_mixup_and_cutmix_trains_and_resumes_bit_for_bit(run, tiny_data, tmp_path):
    """Both on, through the CLI: the draws come from the run's RNG, which the checkpoint
    carries, so a run interrupted and resumed ends where the uninterrupted one does."""
    from tests.conftest import FAST, assert_exact_resume

    common = ["--data", tiny_data, *FAST, "--epochs", "1", "--eval-every", "0",
              "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--mixup-prob", "0.8",
              "--log-every", "2", "--label-smoothing", "0.1"]  # fmt: skip
    assert_exact_resume(run, common, tmp_path, steps=12)


def test_mixing_refuses_the_triton_cross_entropy():
    from tests.config.test_config import resolved

    with pytest.raises(UserError, match="leave xent out with --mixup-alpha"):
        resolved(["--data", "/d", "--mixup-alpha", "0.2", "--triton-kernels", "xent"])


def test_one_kind_alone_computes_what_both_would_on_its_draws():
    images, labels = batch(3)
    cut, mixup = draw(0.6, 5, 7, cutmix=True), draw(0.6)
    for d, kinds in ((cut, {"mixup": False}), (mixup, {"cutmix": False})):
        alone = apply(images, labels, d, CLASSES, **kinds)
        both = apply(images, labels, d, CLASSES)
        assert torch.equal(alone[0], both[0]) and torch.equal(alone[1], both[1])
