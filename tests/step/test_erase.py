"""Random erasing on the device against torchvision's v2.RandomErasing on the same box, and
its draws."""

import pytest
import torch
from torchvision.transforms import v2

from fasttrain.step.erase import Eraser, apply

N, C, H, W = 4, 3, 20, 24


@pytest.mark.parametrize("seed", range(5))
def test_the_box_is_torchvisions_on_the_same_draw(seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(N, C, H, W, generator=g).contiguous(memory_format=torch.channels_last)
    tv = v2.RandomErasing(p=1.0, value=0)
    want, params = [], []
    for k in range(N):
        torch.manual_seed(seed * 10 + k)
        p = tv.make_params([images[k]])
        params.append((p["i"], p["j"], p["h"], p["w"]))
        want.append(tv.transform(images[k], p))
    t = lambda k: torch.tensor([q[k] for q in params])  # noqa: E731
    got = apply(images, t(0), t(1), t(2), t(3), torch.ones(N, dtype=torch.bool))
    torch.testing.assert_close(got, torch.stack(want))
    assert got.is_contiguous(memory_format=torch.channels_last)
    untouched = apply(images, t(0), t(1), t(2), t(3), torch.zeros(N, dtype=torch.bool))
    assert torch.equal(untouched, images)


def test_the_draws_follow_torchvisions_ranges():
    eraser = Eraser(0.25)
    draws = [eraser.draw(64, H, W) for _ in range(100)]
    top, left, h, w, erase = (torch.cat(x) for x in zip(*draws, strict=True))
    assert abs(erase.float().mean() - 0.25) < 0.03
    assert (h < H).all() and (w < W).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= H).all() and (left + w <= W).all() and (top >= 0).all()
    area = (h * w).float() / (H * W)
    assert area.min() > 0.005 and area.max() < 0.45  # U(0.02, 0.33), rounded to whole pixels
    again = Eraser(0.25)
    torch.rand(10)  # its own generator: torch's global one does not move it
    assert torch.equal(again.draw(64, H, W)[0], draws[0][0])


def test_a_run_with_random_erasing_and_mixup_resumes_bit_for_bit(run, tiny_data, tmp_path):
    from tests.conftest import FAST, assert_exact_resume

    common = ["--data", tiny_data, *FAST, "--epochs", "1", "--eval-every", "0", "--log-every",
              "2", "--random-erase", "0.5", "--cutmix-alpha", "1.0"]  # fmt: skip
    assert_exact_resume(run, common, tmp_path, steps=12)
    state = torch.load(next((tmp_path / "whole").glob("ckpt-*.pt")), weights_only=True)
    assert set(state["augment_rng"][0]) == {"mix", "erase"}
