"""ResNet's stem convolution (7x7, stride 2, 3 -> 64 channels, 224 px, fp16 channels_last,
batch 256) in the layouts cuDNN might run faster: the image as it is, padded with zero channels
to 4 or 8 (the weights likewise; ``fused_resnet.STEM_CHANNELS`` is what the fused path pads to),
or rearranged space-to-depth (each 2x2 patch of pixels into channels: 12 channels at 115 px, a
4x4 kernel at stride 1; padded to 16). Forward and weight gradient (training needs no image
gradient) timed apart, with cuDNN autotuning as the trainer sets it; the padding itself, as
inductor compiles it, is its own row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

ITER = 30
CL = torch.channels_last
LAYOUTS = ["3 channels", "padded to 4", "padded to 8", "space-to-depth 12", "space-to-depth 16"]


def pad_channels(t: torch.Tensor, channels: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, 0, 0, channels - t.shape[1])).contiguous(memory_format=CL)


def space_to_depth(t: torch.Tensor, pad: tuple[int, int, int, int], channels: int) -> torch.Tensor:
    """Each 2x2 patch of ``t`` (after ``pad``) into channels, then zero channels up to
    ``channels``: the image as (N, 12, 115, 115), or the 7x7 weights (padded to 8x8) as 4x4."""
    t = F.pad(t, pad)
    n, c, h, w = t.shape
    t = t.view(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return pad_channels(t.reshape(n, c * 4, h // 2, w // 2), channels)


def layouts() -> dict[str, tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Each layout's (image, weights, stride, padding), from one image and one set of weights."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 3, 224, 224, device="cuda", dtype=torch.half, generator=g)
    w = torch.randn(64, 3, 7, 7, device="cuda", dtype=torch.half, generator=g) * 0.1
    x, w = x.contiguous(memory_format=CL), w.contiguous(memory_format=CL)
    s2d = {c: (space_to_depth(x, (3,) * 4, c), space_to_depth(w, (0, 1) * 2, c)) for c in (12, 16)}
    return {
        "3 channels": (x, w, 2, 3),
        "padded to 4": (pad_channels(x, 4), pad_channels(w, 4), 2, 3),
        "padded to 8": (pad_channels(x, 8), pad_channels(w, 8), 2, 3),
        "space-to-depth 12": (*s2d[12], 1, 0),
        "space-to-depth 16": (*s2d[16], 1, 0),
    }


def run(benchmark, fn) -> None:
    def block() -> None:
        for _ in range(ITER):
            fn()
        torch.cuda.synchronize()

    benchmark.pedantic(block, rounds=10, iterations=1, warmup_rounds=2)
    benchmark.extra_info["ms_per_call"] = benchmark.stats.stats.median / ITER * 1e3


@pytest.fixture(scope="module")
def stems():
    torch.backends.cudnn.benchmark = True  # as the trainer sets it
    return layouts()


@pytest.mark.benchmark(group="stem convolution")
@pytest.mark.parametrize("part", ["forward", "weight gradient"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stem_convolution(benchmark, stems, layout, part):
    x, w, stride, padding = stems[layout]
    reference = F.conv2d(*stems["3 channels"][:2], stride=2, padding=3)
    out = F.conv2d(x, w, stride=stride, padding=padding)
    torch.testing.assert_close(out, reference, rtol=2e-3, atol=2e-2)  # the same convolution
    if part == "forward":
        run(benchmark, lambda: F.conv2d(x, w, stride=stride, padding=padding))
    else:
        grad = torch.randn_like(out)
        run(
            benchmark,
            lambda: torch.ops.aten.convolution_backward(
                grad, x, w, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0], 1,
                [False, True, False],
            ),
        )  # fmt: skip


@pytest.mark.benchmark(group="stem convolution")
@pytest.mark.parametrize("channels", [4, 8])
def test_stem_padding(benchmark, stems, channels):
    """What padding the image costs, compiled (the fused step pays it once per step)."""
    x = stems["3 channels"][0]
    pad = torch.compile(lambda t: pad_channels(t, channels), dynamic=False)
    run(benchmark, lambda: pad(x))
