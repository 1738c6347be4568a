"""The training step alone (ResNet-50, synthetic channels_last data): eager, compiled, and each
with the whole-step CUDA graph, in bf16 at batch 256; then the compiled, graphed step's
precisions and BatchNorm paths (bf16 and fp16, each plain and with ``--cudnn-bn``; fp16 with
``--fused-bn``) at batch 256 and 512, bf16 and fp16 ``--fused-bn`` under ``--compile-mode
auto``, and ``--fused-bn``'s variants:

- cuDNN's autotuning timing 10 or every plan per convolution;
- its fused convolutions' cuDNN plans timed eagerly or replayed from a CUDA graph;
- the BN prologue folded into none, the 3x3 or all of the convolutions;
- its ReLU gradient masked by the normalise pass's input or output;
- with or without each block end's masked gradient stored once and its stem's BN run as the
  others;
- its stem's image padded to 4 channels or not;
- its weights cast to fp16 once or again in the backward;
- its BNs' batch counts by one multi-tensor add or one kernel each;
- its normalise passes' scale and bias saved as copies or marked;
- its graph's memsets kept as memset nodes or replaced by fill kernels;
- its stem's max-pool by the row or the window kernels (in both compile modes);
- one of inductor's options on top of each compile mode's.

A round is 25 steps ending in a device sync, after 30 warm-up steps (compile and capture
happen there). img/s and peak memory in ``extra_info``.

Then what each recipe piece costs in the compiled, graphed bf16 step at batch 256 (EMA,
mixup/CutMix, random erasing, gradient clipping, LARS, and torchvision's v2 pieces together),
and the step at the train sizes of a progressive-resizing schedule (160, 192 and 224 px)."""

from __future__ import annotations

import pytest
import torch
from common import make_step  # bench/common.py (pytest puts bench/ on sys.path via rootdir)

from fasttrain.run.resolve import FASTEST_INDUCTOR_OPTIONS

BATCH, BLOCK = 256, 25


def time_step(benchmark, one, step, batch: int) -> None:
    """30 warm-up steps (compile and capture happen there), then rounds of ``BLOCK`` steps
    ending in a device sync; img/s and whether capture failed into ``extra_info``."""

    def block() -> None:
        for _ in range(BLOCK):
            one()
        torch.cuda.synchronize()

    for _ in range(30):
        one()
    benchmark.pedantic(block, rounds=6, iterations=1, warmup_rounds=1)
    benchmark.extra_info["img_per_s"] = batch * BLOCK / benchmark.stats.stats.median
    benchmark.extra_info["capture_failed"] = step.capture_failed


@pytest.mark.benchmark(group="step")
@pytest.mark.parametrize("kind", ["eager", "compiled", "eager+graph", "compiled+graph"])
def test_step(benchmark, kind):
    one, step, _ = make_step(kind, BATCH)
    time_step(benchmark, one, step, BATCH)


@pytest.mark.benchmark(group="step paths")
@pytest.mark.parametrize("batch", [256, 512])
@pytest.mark.parametrize(
    "path", ["bf16", "bf16 cudnn-bn", "fp16", "fp16 cudnn-bn", "fp16 fused-bn"]
)
def test_step_path(benchmark, path, batch):
    torch.cuda.reset_peak_memory_stats()
    amp, bn = path.split()[0], path.split()[-1]
    one, step, _ = make_step(
        "compiled+graph", batch, amp=amp, fused_bn=bn == "fused-bn", cudnn_bn=bn == "cudnn-bn"
    )
    time_step(benchmark, one, step, batch)
    benchmark.extra_info["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30


@pytest.mark.benchmark(group="step paths, --compile-mode auto")
@pytest.mark.parametrize("path", ["bf16", "fp16 fused-bn"])
def test_step_path_tuned(benchmark, path):
    """The default bf16 step and the fp16 --fused-bn one at batch 256 under --compile-mode auto
    (default plus inductor's coordinate-descent tuning) on the Triton max-pool, as the trainer's
    auto settings run them on a GPU: minutes of tuning per path on a first start, cached for
    later ones."""
    torch.cuda.reset_peak_memory_stats()
    amp, fused = path.split()[0], path.endswith("fused-bn")
    tuned = {"train.inductor_options": FASTEST_INDUCTOR_OPTIONS}  # what auto resolves to
    one, step, _ = make_step(
        "compiled+graph", BATCH, amp=amp, fused_bn=fused, kernels="maxpool", overrides=tuned
    )
    time_step(benchmark, one, step, BATCH)
    benchmark.extra_info["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30


def time_fused_default(benchmark) -> None:
    """The fp16 --fused-bn step at batch 256 on the Triton max-pool as the settings now stand:
    its first step's seconds (compile, cuDNN's plans, capture), then its rounds, and its peak
    memory."""
    import time

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    one, step, _ = make_step("compiled+graph", BATCH, amp="fp16", fused_bn=True, kernels="maxpool")
    one()
    torch.cuda.synchronize()
    benchmark.extra_info["first_step_s"] = time.perf_counter() - start
    time_step(benchmark, one, step, BATCH)
    benchmark.extra_info["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30


@pytest.mark.benchmark(group="cuDNN plans timed per convolution")
@pytest.mark.parametrize("limit", [10, 0], ids=["10 (torch's default)", "every plan"])
def test_cudnn_plan_limit(benchmark, limit, monkeypatch):
    """The fp16 --fused-bn step at batch 256 on the Triton max-pool with cuDNN's autotuning
    timing the first 10 plans its heuristics rank for each of torch's own convolutions (torch's
    ``cudnn.benchmark_limit``) or every plan (0): whether a longer search finds faster kernels
    for the bare convolutions (the backward's, the stem's). Start-up time in ``extra_info``."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark_limit", limit)
    time_fused_default(benchmark)


# which convolutions of --fused-bn's model fold the previous BN's normalise + ReLU in as they read
# (FusedResNet's ``fold``); the others read it from an elementwise pass
FOLDS = {"none (the default)": (), "3x3": (3,), "all": (1, 3)}


def time_fused_variant(
    benchmark, monkeypatch, kernels: str = "none", overrides: dict | None = None, **options
) -> None:
    """The fp16 --fused-bn step at batch 256 with ``FusedResNet(**options)`` as the model that
    ``build_model`` constructs, the ``--triton-kernels`` named and the settings ``overrides``
    (``make_step``'s), and its peak memory."""
    import fasttrain.model.fused_resnet as fused_resnet

    class Variant(fused_resnet.FusedResNet):
        def __init__(self, arch: str, **kwargs):
            super().__init__(arch, **options, **kwargs)

    monkeypatch.setattr(fused_resnet, "FusedResNet", Variant)
    torch.cuda.reset_peak_memory_stats()
    one, step, _ = make_step(
        "compiled+graph", BATCH, amp="fp16", fused_bn=True, kernels=kernels, overrides=overrides
    )
    time_step(benchmark, one, step, BATCH)
    benchmark.extra_info["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30


@pytest.mark.benchmark(group="fused-bn prologue")
@pytest.mark.parametrize("fold", list(FOLDS))
def test_fused_bn_fold(benchmark, fold, monkeypatch):
    """The fp16 --fused-bn step at batch 256 with the prologue folded into none, the 3x3 or all
    of the convolutions: what the default (none) was chosen by."""
    time_fused_variant(benchmark, monkeypatch, fold=FOLDS[fold])


@pytest.mark.benchmark(group="fused-bn ReLU mask")
@pytest.mark.parametrize("mask", ["input (the default)", "output"])
def test_fused_bn_relu_mask(benchmark, mask, monkeypatch):
    """The fp16 --fused-bn step at batch 256 with each normalise pass's ReLU gradient masked by
    the pass's input (``affine_relu``, the default) or by its output (``torch.relu``,
    ``FusedResNet(mask_from_input=False)``): about half a pass over every BN output apart in
    ``bench/traffic.py``'s count, what the default was chosen by."""
    time_fused_variant(benchmark, monkeypatch, mask_from_input=mask.startswith("input"))


# FusedResNet's block end and stem, each on fasttrain's Triton max-pool (what --triton-kernels
# auto runs on a GPU; it takes the fused stem's normalise + ReLU in)
LEANER: dict[str, dict] = {
    "neither": {"store_block_grad": False, "fuse_stem": False},
    "store_block_grad": {"fuse_stem": False},
    "fuse_stem": {"store_block_grad": False},
    "both (the default)": {},
}


@pytest.mark.benchmark(group="fused-bn block-end gradient and stem")
@pytest.mark.parametrize("options", list(LEANER))
def test_fused_bn_leaner_backward(benchmark, options, monkeypatch):
    """The fp16 --fused-bn step at batch 256 with each block end's masked gradient stored once
    rather than recomputed by each of its readers (``store_block_grad``), with the stem's BN run
    as the others and its normalise + ReLU applied inside the Triton max-pool (``fuse_stem``),
    with both (the default) and with neither: less traffic in ``bench/traffic.py``'s count, and
    what the default was chosen by."""
    time_fused_variant(benchmark, monkeypatch, "maxpool", **LEANER[options])


@pytest.mark.benchmark(group="fused-bn block-end ReLU mask")
@pytest.mark.parametrize("mask", ["the output", "bits (the default)"])
@pytest.mark.parametrize("mode", ["default", "auto"])
def test_fused_bn_block_mask(benchmark, mode, mask, monkeypatch):
    """The fp16 --fused-bn step at batch 256 (on the Triton max-pool) with each block end's
    backward masking its gradient by reading the block's output or by one bit per element kept
    from the forward (``pack_block_mask``): a sixteenth of a pass for a whole one in each block
    end's backward kernel, inductor writing the bits in the forward kernel that writes the
    output (``signs.relu_and_signs``). In ``default`` mode, and as ``--compile-mode auto``
    tunes it (minutes the first time)."""
    overrides = {"train.inductor_options": FASTEST_INDUCTOR_OPTIONS} if mode == "auto" else None
    time_fused_variant(
        benchmark, monkeypatch, "maxpool", overrides=overrides, pack_block_mask=mask != "the output"
    )


@pytest.mark.benchmark(group="fused-bn stem channels")
@pytest.mark.parametrize("stem", ["3 channels", "padded to 4 (the default)"])
def test_fused_bn_stem_channels(benchmark, stem, monkeypatch):
    """The fp16 --fused-bn step at batch 256 (on the Triton max-pool) with the stem's
    convolution reading the 3-channel image as it is, or padded with a zero channel to 4
    (``FusedResNet(pad_stem=...)``): what the default was chosen by."""
    time_fused_variant(benchmark, monkeypatch, "maxpool", pad_stem=stem.startswith("padded"))


@pytest.mark.benchmark(group="fused-bn weight casts")
@pytest.mark.parametrize("cast", ["once, kept (the default)", "again in the backward"])
def test_fused_bn_weight_cast(benchmark, cast, monkeypatch):
    """The fp16 --fused-bn step at batch 256 (on the Triton max-pool) with each convolution's
    fp32 weight cast to fp16 once and the cast kept for the backward (``cast_once``), or cast
    inside ``conv_bn`` and again in the compiled backward: what the default was chosen by."""
    time_fused_variant(benchmark, monkeypatch, "maxpool", cast_once=cast.startswith("once"))


@pytest.mark.benchmark(group="fused-bn batch counts")
@pytest.mark.parametrize("count", ["one add for every BN (the default)", "one per BN"])
def test_fused_bn_batch_count(benchmark, count, monkeypatch):
    """The fp16 --fused-bn step at batch 256 (on the Triton max-pool) with every BN's
    ``num_batches_tracked`` counted by one multi-tensor add before the first BN (``count_once``,
    one kernel) or by each BN as it finalizes (a one-element kernel per BN, 53 in ResNet-50):
    the same counts, with 52 kernels fewer in the forward."""
    time_fused_variant(benchmark, monkeypatch, "maxpool", count_once=count.startswith("one add"))


@pytest.mark.benchmark(group="fused-bn saved scale and bias")
@pytest.mark.parametrize("saved", ["copies", "marked (the default)"])
def test_fused_bn_saved_affine(benchmark, saved, monkeypatch):
    """The fp16 --fused-bn step at batch 256 (on the Triton max-pool) with each normalise pass's
    scale and bias saved for the backward as copies (``kept``, two small copy kernels per pass)
    or as the tensors themselves marked ``stored`` (``FusedResNet(copy_affine=False)``): the
    same tensors saved, without the copies' launches."""
    time_fused_variant(benchmark, monkeypatch, "maxpool", copy_affine=saved.startswith("copies"))


@pytest.mark.benchmark(group="fused-bn graph memsets")
@pytest.mark.parametrize("memsets", ["memset nodes", "fill kernels (the default)"])
def test_fused_bn_graph_memsets(benchmark, memsets, monkeypatch):
    """The fp16 --fused-bn step at batch 256 (on the Triton max-pool) replayed from a graph whose
    memsets (cuDNN's, before each fused convolution) stay memset nodes
    (``FASTTRAIN_GRAPH_MEMSETS=keep``) or are replaced by fill kernels (``kernels``, the default,
    ``step/graph_memsets.py``): the same bytes written, with less idle time around them. ``-k
    "graph_memsets and nodes"`` or ``and fill`` times one of them."""
    value = "keep" if memsets.startswith("memset") else "kernels"
    monkeypatch.setenv("FASTTRAIN_GRAPH_MEMSETS", value)
    time_fused_variant(benchmark, monkeypatch, "maxpool")


@pytest.mark.benchmark(group="fused-bn stem pool kernels")
@pytest.mark.parametrize("mode", ["default", "auto"])
@pytest.mark.parametrize("pool", ["rows (the default)", "windows"])
def test_fused_bn_pool_kernels(benchmark, pool, mode, monkeypatch):
    """The fp16 --fused-bn step at batch 256 with its stem's max-pool by the row kernels
    (``maxpool_rows``) or the window kernels (``maxpool.ROWS = False``), in ``default`` mode and
    under ``--compile-mode auto`` (minutes of tuning on a first start)."""
    from fasttrain.kernels import maxpool

    monkeypatch.setattr(maxpool, "ROWS", pool.startswith("rows"))
    tuned = {"train.inductor_options": FASTEST_INDUCTOR_OPTIONS} if mode == "auto" else None
    time_fused_variant(benchmark, monkeypatch, "maxpool", overrides=tuned)


@pytest.mark.benchmark(group="fused-bn stem BN in the pool")
@pytest.mark.parametrize("mode", ["default", "auto"])
@pytest.mark.parametrize("stem", ["whole BN in the pool", "normalise + ReLU only (the default)"])
def test_fused_bn_stem_bn_in_pool(benchmark, stem, mode, monkeypatch):
    """The fp16 --fused-bn step at batch 256 with its stem's whole BN inside the Triton max-pool,
    whose backward writes the convolution output's gradient in one pass
    (``FusedResNet(stem_bn_in_pool=True)``), or only its normalise + ReLU, the BN's backward
    left to inductor (the default): in ``default`` mode and under ``--compile-mode auto``."""
    tuned = {"train.inductor_options": FASTEST_INDUCTOR_OPTIONS} if mode == "auto" else None
    whole = stem.startswith("whole")
    time_fused_variant(benchmark, monkeypatch, "maxpool", overrides=tuned, stem_bn_in_pool=whole)


# inductor's options screened on the fused step (each as --inductor-options takes it)
INDUCTOR_SCREEN = [
    "none",
    "triton.prefer_nd_tiling",
    "triton.tile_reductions",
    "triton.enable_pdl",
    "triton.multi_kernel=1",
    "aggressive_fusion",
    "combo_kernels",
]


@pytest.mark.benchmark(group="fused-bn inductor options")
@pytest.mark.parametrize("mode", ["default", "auto"])
@pytest.mark.parametrize("options", INDUCTOR_SCREEN)
def test_fused_bn_inductor_options(benchmark, options, mode, monkeypatch):
    """The fp16 --fused-bn step at batch 256 (on the Triton max-pool) with one of inductor's
    options on top of what the mode sets: in ``default`` mode and under ``--compile-mode auto``
    (the coordinate-descent tuning, minutes on a first start). An option this torch lacks
    skips."""
    from torch._inductor import config as inductor_config

    if options != "none" and options.split("=")[0] not in inductor_config.get_config_copy():
        pytest.skip(f"this torch's inductor has no {options.split('=')[0]}")
    given = [FASTEST_INDUCTOR_OPTIONS] if mode == "auto" else []
    given += [options] if options != "none" else []
    overrides = {"train.inductor_options": ",".join(given) or "none"}
    time_fused_variant(benchmark, monkeypatch, "maxpool", overrides=overrides)


# torchvision's v2 recipe's in-step pieces (its augmentation in the loader is measured end to end)
V2_PIECES = {"train.model_ema": True, "train.mixup_alpha": 0.2, "train.cutmix_alpha": 1.0,
             "train.random_erase": 0.1}  # fmt: skip
# each recipe piece by its settings (config keys), and the Triton kernels it runs with
PIECES: dict[str, tuple[dict, str]] = {
    "none": ({}, "none"),
    "model-ema": ({"train.model_ema": True}, "none"),
    "mixup+cutmix": ({"train.mixup_alpha": 0.2, "train.cutmix_alpha": 1.0}, "none"),
    "random-erase 0.25": ({"train.random_erase": 0.25}, "none"),
    "clip-grad-norm": ({"optim.clip_grad_norm": 1.0}, "none"),
    "lars triton": ({"optim.opt": "lars"}, "sgd"),  # --opt lars on one GPU process
    "lars foreach": ({"optim.opt": "lars"}, "none"),  # --opt lars under DDP
    "v2 pieces": (V2_PIECES, "none"),
}


@pytest.mark.benchmark(group="recipe pieces")
@pytest.mark.parametrize("piece", list(PIECES))
def test_recipe_piece(benchmark, piece):
    overrides, kernels = PIECES[piece]
    one, step, _ = make_step("compiled+graph", BATCH, kernels=kernels, overrides=overrides)
    time_step(benchmark, one, step, BATCH)


@pytest.mark.benchmark(group="train size")
@pytest.mark.parametrize("size", [160, 192, 224])
def test_image_size(benchmark, size):
    one, step, _ = make_step("compiled+graph", BATCH, image_size=size)
    time_step(benchmark, one, step, BATCH)
