"""--progressive-resizing: the schedule against FFCV's, its flag and YAML forms, and every train
loader changing size with the epoch (DALI by rebuilding its pipeline from its own checkpoint),
with exact resume across a size change."""

import json

import numpy as np
import pytest
import torch
import yaml

from fasttrain.config.cli import parse_args
from fasttrain.config.resolution import Resolution
from fasttrain.data.folder import scan_folder
from fasttrain.data.synthetic import SyntheticLoader
from fasttrain.data.torchvision import ImageFolderDataset
from fasttrain.errors import UserError
from tests.config.test_config import resolved
from tests.conftest import FAST, Run, assert_exact_resume


def ffcv_resolution(epoch, min_res, max_res, end_ramp, start_ramp):
    """ffcv-imagenet's train_imagenet.py ``get_resolution``, the schedule's reference."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


@pytest.mark.parametrize(
    "start, end, first, last",
    [
        (160, 192, 11, 13),
        (160, 192, 29, 34),
        (160, 192, 65, 76),
        (128, 256, 2, 20),
        (160, 160, 0, 0),
    ],
)
def test_sizes_are_ffcvs(start, end, first, last):
    r = Resolution.parse(f"{start}:{end}:{first}:{last}")
    for epoch in range(last + 5):
        assert r.size_at(epoch) == ffcv_resolution(epoch, start, end, last, first), epoch
    sizes = r.sizes(last + 5)
    assert sizes[0] == start and sizes[-1] == end and sizes == sorted(set(sizes))


def test_describe_names_each_change_once():
    r = Resolution(160, 192, 11, 13)
    assert r.describe(16) == "160 px from epoch 0, 192 px from epoch 12"
    assert r.describe(10) == "160 px from epoch 0"
    assert Resolution(128, 256, 0, 4).describe(6) == (
        "128 px from epoch 0, 160 px from epoch 1, 192 px from epoch 2, 224 px from epoch 3, "
        "256 px from epoch 4"
    )
    assert not Resolution.fixed(224).progressive and Resolution(160, 192).progressive


def test_interpolated_sizes_stay_between_the_ends():
    """Rounding to 32 never leaves [START, END] when the ends are not multiples of 32."""
    r = Resolution(176, 200, 0, 10)
    assert all(176 <= r.size_at(e) <= 200 for e in range(12))


@pytest.mark.parametrize(
    "value, says",
    [
        ("160:192:11", "expected START:END:FROM_EPOCH:TO_EPOCH"),
        ("160:192:a:13", "expected START:END:FROM_EPOCH:TO_EPOCH"),
        ("16:192:0:4", "at least 32 px"),
        ("160:192:13:11", "TO_EPOCH at least FROM_EPOCH"),
    ],
)
def test_a_bad_schedule_is_one_line_naming_the_flag(run, value, says):
    code, err = run(*FAST, "--loader", "synthetic", "--progressive-resizing", value)
    assert code == 2 and "--progressive-resizing" in err and says in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_flag_and_a_yaml_list_give_the_same_schedule(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"data": {"progressive_resizing": [160, 192, 11, 13]}}))
    from_yaml, _ = parse_args(["--config", str(recipe)], cuda_available=False)
    from_flag, _ = parse_args(["--progressive-resizing", "160:192:11:13"], cuda_available=False)
    assert from_yaml.data.progressive_resizing == from_flag.data.progressive_resizing
    assert from_flag.data.progressive_resizing == "160:192:11:13"
    off, _ = parse_args(["--progressive-resizing", "none"], cuda_available=False)
    assert off.data.progressive_resizing is None
    recipe.write_text(yaml.safe_dump({"data": {"progressive_resizing": [160, 192.5, 11, 13]}}))
    with pytest.raises(UserError, match=r"r\.yaml: data\.progressive_resizing: expected START"):
        parse_args(["--config", str(recipe)], cuda_available=False)


def test_val_crops_at_the_final_size_and_a_given_image_size_is_named_unused():
    notes: list[str] = []
    argv = [*FAST, "--loader", "synthetic", "--progressive-resizing", "32:64:0:2"]
    cfg = resolved(argv, cuda=False, notes=notes)
    assert cfg.data.val_crop_size == 64
    assert any("--image-size 32: unused for training" in n for n in notes), notes


def test_synthetic_and_torchvision_loaders_change_size_with_the_epoch(tiny_data):
    r = Resolution(32, 64, 0, 1)
    synthetic = SyntheticLoader(
        batch_size=4, image_size=32, num_classes=4, steps=2, device=torch.device("cpu"),
        dtype=torch.float32, channels_last=True, seed=0, resolution=r,
    )  # fmt: skip
    shapes = []
    for epoch in (0, 1, 0):
        synthetic.set_epoch(epoch)
        shapes.append(next(iter(synthetic))[0].shape[-1])
    assert shapes == [32, 64, 32]
    samples = scan_folder(tiny_data).train
    dataset = ImageFolderDataset(samples, True, 32, seed=0, resolution=r)
    assert dataset[(0, 0)][0].shape == (32, 32, 3) and dataset[(0, 1)][0].shape == (64, 64, 3)


def test_dali_changes_size_at_the_epoch_with_the_samples_and_crops_it_would_have_had(tiny_data):
    """A new size rebuilds DALI's pipeline from its own checkpoint: the same samples, in the
    same order, as a pipeline that never changed size, and the same crop windows (the smaller
    crop matches the larger one resized)."""
    pytest.importorskip("nvidia.dali")
    from tests.data.test_dali import epoch, indexed, loader

    samples = indexed(scan_folder(tiny_data).train)
    fixed = loader(samples, batch_size=32)
    ref = epoch(fixed, 0) + epoch(fixed, 1) + epoch(fixed, 2)
    growing = loader(samples, batch_size=32, resolution=Resolution(32, 64, 1, 2))
    got = epoch(growing, 0) + epoch(growing, 1) + epoch(growing, 2)
    per_epoch = len(ref) // 3
    assert [x.shape[-1] for x, _ in got] == [32] * per_epoch * 2 + [64] * per_epoch
    for (_, ya), (_, yb) in zip(ref, got, strict=True):
        assert torch.equal(ya, yb)
    for (xa, _), (xb, _) in zip(ref[: 2 * per_epoch], got[: 2 * per_epoch], strict=True):
        assert torch.equal(xa, xb)
    big, small = got[2 * per_epoch][0].float(), ref[2 * per_epoch][0].float()
    down = torch.nn.functional.interpolate(big, size=32, mode="bilinear", antialias=True)
    assert (down - small).abs().mean() < 0.15  # the same window, resampled (normalised units)


def test_dali_resumes_across_a_size_change(tiny_data):
    pytest.importorskip("nvidia.dali")
    from tests.data.test_dali import epoch, indexed, loader

    samples = indexed(scan_folder(tiny_data).train)
    r = Resolution(32, 64, 0, 1)
    a = loader(samples, batch_size=32, resolution=r)
    epoch(a, 0)
    a.set_epoch(1)
    it = iter(a)
    next(it)
    state = a.state_dict()  # one batch into the 64 px epoch
    rest = [(x.clone(), y.clone()) for x, y in it] + epoch(a, 2)
    b = loader(samples, batch_size=32, resolution=r, state=state)
    resumed = epoch(b, 1, 1) + epoch(b, 2)
    assert len(resumed) == len(rest) and rest[0][0].shape[-1] == 64
    for (xa, ya), (xb, yb) in zip(rest, resumed, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


@pytest.mark.parametrize("loader", ["dali", "torchvision"])
def test_a_progressive_run_resumes_bitwise_and_reports_the_change(run, tiny_data, tmp_path, loader):
    """Through the CLI: 32 px in epoch 0, 64 px in epoch 1; interrupted at step 4 (epoch 0) and
    at step 6 (the epoch's end, before the change) and resumed, it ends bitwise where the
    uninterrupted run does, with either loader."""
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    common = ["--data", tiny_data, *FAST, "--loader", loader, "--dali-threads", "2",
              "--epochs", "2", "--accum-steps", "2", "--log-every", "2", "--eval-every", "0",
              "--progressive-resizing", "32:64:0:1"]  # fmt: skip
    assert_exact_resume(run, common, tmp_path, steps=12)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert [(r["epoch"], r["size"]) for r in summary["resizes"]] == [(1, 64)]
    assert summary["img_per_s_by_size"].keys() == {"32", "64"}
    assert all(rate > 0 for rate in summary["img_per_s_by_size"].values())
    log = (tmp_path / "whole" / "log-rank0.txt").read_text()
    assert "--progressive-resizing: 32 px from epoch 0, 64 px from epoch 1" in log
    assert "epoch 1 trains on 64 px crops (was 32)" in log


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dali_on_the_gpu_rebuilds_its_pipeline_at_a_new_size(tiny_data):
    """The GPU pipeline (mixed decoder, hardware JPEG decode) rebuilt from its checkpoint: the
    labels go on as a pipeline that never changed size, at the new size."""
    pytest.importorskip("nvidia.dali")
    from tests.data.test_dali import epoch, indexed, loader

    samples = indexed(scan_folder(tiny_data).train)
    fixed = loader(samples, batch_size=32, device="cuda")
    ref = epoch(fixed, 0) + epoch(fixed, 1)
    growing = loader(samples, batch_size=32, device="cuda", resolution=Resolution(32, 64, 0, 1))
    got = epoch(growing, 0) + epoch(growing, 1)
    per_epoch = len(ref) // 2
    assert [x.shape[-1] for x, _ in got] == [32] * per_epoch + [64] * per_epoch
    assert all(x.is_cuda for x, _ in got)
    for (_, ya), (_, yb) in zip(ref, got, strict=True):
        assert torch.equal(ya, yb)


def test_rates_by_size_read_each_size_as_a_run_of_its_own():
    from fasttrain.metrics.rates import rates_by

    r = Resolution(32, 64, 1, 2)  # 32 px in epochs 0-1, 64 px from epoch 2
    # (epoch, images, seconds): each size's first epoch is left out where it has a later one
    intervals = [(0, 100, 10.0), (1, 100, 1.0), (2, 50, 1.0), (2, 50, 0.5), (3, 60, 1.0)]
    assert rates_by(intervals, r.size_at) == {32: 100.0, 64: 60.0}


def test_dali_takes_each_sizes_own_batch_in_the_same_sample_order_and_resumes_across_it(
    tiny_data,
):
    """A batch per size (``--batch-size auto``): DALI's pipeline is rebuilt with the new batch
    at the epoch's start; the epoch's samples come in the order a fixed batch gives them, and a
    run resumed in the new batch's epoch yields exactly what the uninterrupted one does."""
    pytest.importorskip("nvidia.dali")
    from tests.data.test_dali import epoch, indexed, loader

    samples = indexed(scan_folder(tiny_data).train)
    r, batches = Resolution(32, 64, 1, 2), {32: 16, 64: 32}
    fixed = loader(samples, batch_size=16)
    ref = [epoch(fixed, e) for e in range(3)]
    mixed = loader(samples, batch_size=16, resolution=r, batches=batches)
    assert [mixed.batches_in(e) for e in range(3)] == [12, 12, 6]  # 192 images; 64 px at 2
    got = [epoch(mixed, e) for e in range(3)]
    assert [x.shape[0] for x, _ in got[2]] == [32] * 6 and got[2][0][0].shape[-1] == 64
    for want, have in zip(ref, got, strict=True):
        assert torch.equal(torch.cat([y for _, y in want]), torch.cat([y for _, y in have]))
    a = loader(samples, batch_size=16, resolution=r, batches=batches)
    epoch(a, 0)
    epoch(a, 1)
    a.set_epoch(2)
    it = iter(a)
    next(it)
    state = a.state_dict()  # one batch into the first epoch at the new batch
    rest = [(x.clone(), y.clone()) for x, y in it]
    b = loader(samples, batch_size=16, resolution=r, batches=batches, state=state)
    resumed = epoch(b, 2, 1)
    assert len(resumed) == len(rest) == 5
    for (xa, ya), (xb, yb) in zip(rest, resumed, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


@pytest.mark.parametrize("loader", ["dali", "torchvision"])
def test_a_size_with_its_own_batch_takes_fewer_larger_steps_and_resumes_bitwise(
    run, tiny_data, tmp_path, loader
):
    """--batch-sizes (what --batch-size auto fills in): the 64 px epoch trains at batch 32
    where the 32 px one trains at 16, in half the steps, its LR scaled to its global batch;
    interrupted and resumed (at step 4, and at the end of epoch 0, just before the change), the
    run ends bitwise where the uninterrupted one does."""
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    common = ["--data", tiny_data, *FAST, "--loader", loader, "--dali-threads", "2",
              "--epochs", "2", "--accum-steps", "2", "--log-every", "1", "--eval-every", "0",
              "--warmup-epochs", "0", "--lr-schedule", "step", "--lr-step-epochs", "10",
              "--progressive-resizing", "32:64:0:1", "--batch-sizes", "64:32"]  # fmt: skip
    assert_exact_resume(run, common, tmp_path, steps=6 + 3)  # 192 images: 6 steps, then 3
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["plan"] == {"steps": [6, 3], "global_batches": [32, 64]}
    lrs = [r["lr"] for r in Run.records(tmp_path / "whole", "train")]
    assert lrs == pytest.approx([0.1 * 32 / 256] * 6 + [0.1 * 64 / 256] * 3)
    log = (tmp_path / "whole" / "log-rank0.txt").read_text()
    assert "epoch 1 trains on 64 px crops (was 32) at global batch 64 (was 32), 3 steps" in log
    assert (
        "--batch-sizes 64:32: epoch 0: global batch 32, 6 steps each; epoch 1: global batch 64, "
        "3 steps each"
    ) in log


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--batch-sizes", "64-32"], "expected SIZE:BATCH pairs"),
        (["--batch-sizes", "64:0"], "expected SIZE:BATCH pairs"),
        (["--batch-sizes", "96:32"], "96 px is not a size this run trains at"),
    ],
)
def test_bad_batch_sizes_are_one_line_naming_the_flag(run, extra, says):
    argv = [*FAST, "--loader", "synthetic", "--progressive-resizing", "32:64:0:1", *extra]
    code, err = run(*argv)
    assert code == 2 and "--batch-sizes" in err and says in err, err
    assert len(err.strip().splitlines()) == 1
    code, err = run(*FAST, "--loader", "synthetic", "--batch-sizes", "32:8")
    assert code == 2 and "needs --progressive-resizing" in err, err


def test_synthetic_data_takes_each_sizes_own_batch():
    ld = SyntheticLoader(batch_size=8, image_size=32, num_classes=4, steps=lambda b: 64 // b,
                         device=torch.device("cpu"), dtype=torch.float32, channels_last=True,
                         seed=0, resolution=Resolution(32, 64, 0, 1), batches={64: 16})  # fmt: skip
    assert [ld.batches_in(e) for e in (0, 1)] == [8, 4]
    ld.set_epoch(1)
    got = list(ld)
    assert len(got) == 4 and got[0][0].shape == (16, 3, 64, 64) and got[0][1].shape == (16,)
    ld.set_epoch(0)
    assert next(iter(ld))[0].shape == (8, 3, 32, 32)
