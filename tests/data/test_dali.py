"""The DALI pipelines, run in DALI's CPU mode (device_id=None): the same definitions as on a GPU."""

import pytest
import torch

from fasttrain.data.folder import scan_folder
from tests.conftest import FAST, assert_exact_resume

pytest.importorskip("nvidia.dali")
from fasttrain.data.dali import DaliTrainLoader, DaliValLoader, build_dali_loader


def loader(
    samples,
    *,
    train=True,
    rank=0,
    world=1,
    seed=0,
    batch_size=16,
    channels_last=True,
    device="cpu",
    **kw,
) -> DaliTrainLoader | DaliValLoader:
    return build_dali_loader(
        samples,
        train=train,
        image_size=32,
        batch_size=batch_size,
        threads=2,
        hw_decoder_load=0.99,
        seed=seed,
        rank=rank,
        world=world,
        device=torch.device(device),
        channels_last=channels_last,
        **kw,
    )


def indexed(samples):
    """Label each file with its own index, so the labels say which files came out."""
    return [(path, i) for i, (path, _) in enumerate(samples)]


def epoch(ld, e=0, start=0):
    ld.set_epoch(e, start)
    return [(x.clone(), y.clone()) for x, y in ld]


def test_batches_are_fp16_channels_last_views_of_fixed_buffers(tiny_data):
    ld = loader(scan_folder(tiny_data).train)
    assert len(ld) == 192 // 16
    batches = []
    ld.set_epoch(0)
    for x, y in ld:
        batches.append((x.data_ptr(), y.data_ptr()))
        assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float16
        assert x.is_contiguous(memory_format=torch.channels_last)  # the NHWC buffer, viewed
        assert y.shape == (16,) and y.dtype == torch.int64
        assert x.abs().max() < 10 and x.float().std() > 0.2  # normalised, not raw 0-255
    assert len(set(batches)) == 1  # one buffer, the same addresses every step
    assert (
        ld.fixed_buffers
        and not loader(scan_folder(tiny_data).train, channels_last=False).fixed_buffers
    )


def test_prefetch_depth_reaches_the_pipeline(tiny_data):
    assert loader(scan_folder(tiny_data).train, prefetch=3).pipe.prefetch_queue_depth == 3
    assert loader(scan_folder(tiny_data).train).pipe.prefetch_queue_depth == 4  # default


def test_accumulation_gets_one_buffer_per_micro_batch(tiny_data):
    ld = loader(scan_folder(tiny_data).train, buffers=2)
    ld.set_epoch(0)
    it = iter(ld)
    (x0, _), (x1, _), (x2, _) = next(it), next(it), next(it)
    assert x0.data_ptr() != x1.data_ptr() and x2.data_ptr() == x0.data_ptr()


def test_val_labels_match_their_class_folders(tiny_data):
    samples = scan_folder(tiny_data).val
    labels = torch.cat([y for _, y in epoch(loader(samples, train=False))])
    expected = torch.tensor([label for _, label in samples])
    assert torch.equal(labels[labels >= 0], expected)  # val keeps file order; padding is -1


def test_batches_scheduled_at_the_build_are_those_of_plain_runs(tiny_data):
    samples = indexed(scan_folder(tiny_data).train)
    ld = loader(samples)
    assert ld.scheduled  # the first batches started with the build
    ld.set_epoch(0)
    got = [y.clone() for _, y in ld]
    plain = loader(samples)
    pipe = plain._build(plain.size, plain.batch_size, schedule=False)
    expected = [torch.from_numpy(pipe.run()[1].as_array()).view(-1) for _ in got]
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(got, expected, strict=True))


def test_val_pipeline_is_built_at_the_first_evaluation(tiny_data):
    ld = loader(scan_folder(tiny_data).val, train=False)
    assert ld.pipe is None and len(ld) == 100 // 16 + 1  # nothing built on the way to a step
    first = torch.cat([y for _, y in epoch(ld)])
    pipe = ld.pipe
    assert pipe is not None and torch.equal(torch.cat([y for _, y in epoch(ld)]), first)
    assert ld.pipe is pipe  # built once


def test_train_shards_are_disjoint_and_cover_the_set(tiny_data):
    samples = indexed(scan_folder(tiny_data).train)  # 192 files: 6 batches per rank, no tail
    seen = [torch.cat([y for _, y in epoch(loader(samples, rank=r, world=2))]) for r in range(2)]
    assert len(seen[0]) == len(seen[1]) == 96
    assert not set(seen[0].tolist()) & set(seen[1].tolist())
    assert sorted(torch.cat(seen).tolist()) == list(range(192))


def test_train_order_is_shuffled_deterministically_by_seed(tiny_data):
    samples = indexed(scan_folder(tiny_data).train)
    a, b, c = (epoch(loader(samples, seed=s)) for s in (0, 0, 1))
    labels = [torch.cat([y for _, y in run]).tolist() for run in (a, b, c)]
    assert labels[0] == labels[1] and labels[0] != labels[2]
    assert labels[0] != sorted(labels[0])  # shuffled, not the class-sorted file order
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b, strict=True))
    first_batch_classes = {samples[i][0].split("/")[-2] for i in labels[0][:16]}
    assert len(first_batch_classes) >= 3  # a global shuffle, not a 1,024-sample buffer


def test_each_epoch_is_a_new_permutation(tiny_data):
    ld = loader(indexed(scan_folder(tiny_data).train))
    e0 = torch.cat([y for _, y in epoch(ld, 0)]).tolist()
    e1 = torch.cat([y for _, y in epoch(ld, 1)]).tolist()
    assert sorted(e0) == sorted(e1) == list(range(192)) and e0 != e1


def test_val_counts_every_image_once_across_ranks(tiny_data):
    samples = indexed(scan_folder(tiny_data).val)  # 100 images over 3 ranks: 33/33/34
    counted = []
    for r in range(3):
        ld = loader(samples, train=False, rank=r, world=3)
        for _ in range(2):  # a second evaluation sees the same shard again
            labels = torch.cat([y for _, y in epoch(ld)])
        counted += labels[labels >= 0].tolist()
    assert sorted(counted) == list(range(100))


@pytest.mark.parametrize(
    "batch_size, taken, expected",
    [
        (32, 2, 4 + 6),  # 6 batches of 32 per epoch
        (16, 3, 9 + 12),  # 12 batches of 16
    ],
)
def test_resume_continues_with_the_samples_not_yet_seen(tiny_data, batch_size, taken, expected):
    samples = indexed(scan_folder(tiny_data).train)
    a = loader(samples, batch_size=batch_size)
    a.set_epoch(0)
    it = iter(a)
    for _ in range(taken):
        next(it)
    state = a.state_dict()
    rest = [(x.clone(), y.clone()) for x, y in it] + epoch(a, 1)
    b = loader(samples, batch_size=batch_size, state=state)
    resumed = epoch(b, 0, taken) + epoch(b, 1)
    assert len(resumed) == len(rest) == expected
    for (xa, ya), (xb, yb) in zip(rest, resumed, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prefetch_depths_give_the_same_batches(tiny_data):
    """On the GPU, the default prefetch depth (4) yields the batches that DALI's own depth (2)
    does, in the same order, over two epochs; each batch is read at once on the training
    stream, so a batch read before its decode finished would differ."""
    samples = indexed(scan_folder(tiny_data).train)
    gpu = dict(device="cuda", batch_size=32)
    base = loader(samples, **gpu, prefetch=2)
    ref = epoch(base) + epoch(base, 1)
    ld = loader(samples, **gpu, prefetch=4)
    got = epoch(ld) + epoch(ld, 1)
    assert len(got) == len(ref) == 2 * (192 // 32)
    for (xa, ya), (xb, yb) in zip(ref, got, strict=True):
        assert torch.equal(ya, yb)
        assert (xa.float() - xb.float()).abs().max() < 0.05  # the same decode and crop


@pytest.mark.parametrize("prefetch", [2, 3])
def test_dali_cli_run_resumes_bitwise(run, tiny_data, tmp_path, prefetch):
    common = [
        "--data",
        tiny_data,
        *FAST,
        "--loader",
        "dali",
        "--dali-threads",
        "2",
        "--dali-prefetch",
        str(prefetch),
        "--epochs",
        "2",
        "--accum-steps",
        "2",
        "--log-every",
        "2",
    ]
    # 6 steps per epoch: the step-6 checkpoint is at an epoch's end, so the resumed pipeline
    # must drain the epoch's padded tail exactly as the uninterrupted one does
    assert_exact_resume(run, common, tmp_path, steps=12)
    log = (tmp_path / "whole" / "log-rank0.txt").read_text()
    assert f"DALI loader (CPU decode, 2 threads, {prefetch} batches ahead)" in log
    assert run.records(tmp_path / "whole", "val")[-1]["images"] == 100


def test_missing_dali_is_a_one_line_error_naming_the_extra(run, tiny_data, monkeypatch):
    import fasttrain.data.dali_install as dali

    monkeypatch.setattr(dali, "dali_available", lambda: False)
    code, err = run("--data", tiny_data, *FAST, "--loader", "dali")
    assert code == 2
    assert "NVIDIA DALI is not installed; pip install nvidia-dali-cuda130" in err
    assert "Traceback" not in err


def test_an_undecodable_file_is_a_one_line_error(run, tiny_data, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    next((data / "train" / "class_001").iterdir()).write_bytes(b"\xff\xd8\xff\xe0 truncated")
    code, err = run(
        "--data", data, *FAST, "--loader", "dali", "--epochs", "1", "--output-dir", tmp_path / "o"
    )
    assert code == 1 and "Traceback" not in err
    assert "--loader dali: a train image failed to decode" in err
    assert "--loader torchvision" in err


def test_dali_trains_past_bad_files_once_check_data_listed_them(run, tiny_data, tmp_path):
    import shutil

    from fasttrain.__main__ import main

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    next((data / "train" / "class_001").iterdir()).write_bytes(b"\xff\xd8\xff\xe0 truncated")
    assert (
        main(["check-data", str(data), "--workers", "1", "--output", str(tmp_path / "bad.txt")])
        == 0
    )
    code, err = run(
        "--data",
        data,
        *FAST,
        "--loader",
        "dali",
        "--epochs",
        "1",
        "--exclude-list",
        tmp_path / "bad.txt",
        "--output-dir",
        tmp_path / "o",
    )
    assert code == 0, err


def test_val_crop_and_resize_reach_both_loaders(tiny_data):
    """--val-crop-size / --val-resize-size: the crop sets both loaders' val shape, and the
    resize changes what the crop holds, in DALI's pipeline as in the reference loader."""
    from fasttrain.data.torchvision import build_torchvision_loader

    samples = scan_folder(tiny_data).val[:16]

    def batches(**size):
        dali = build_dali_loader(samples, train=False, batch_size=16, threads=2,
                                 hw_decoder_load=0.99, seed=0, rank=0, world=1,
                                 device=torch.device("cpu"), channels_last=True,
                                 **size)  # fmt: skip
        ref = build_torchvision_loader(samples, train=False, batch_size=16, workers=0, seed=0,
                                       rank=0, world=1, device=torch.device("cpu"),
                                       dtype=torch.float32, channels_last=True, **size)  # fmt: skip
        return epoch(dali)[0][0].float(), next(iter(ref))[0]

    default, default_ref = batches(image_size=40, resize=None)  # shorter side 46, crop 40
    tight, tight_ref = batches(image_size=40, resize=40)  # the whole shorter side
    assert default.shape == default_ref.shape == tight.shape == (16, 3, 40, 40)
    for a, b in ((default, tight), (default_ref, tight_ref)):
        assert (a - b).abs().mean() > 0.1  # another resize, another view of each image
    # the two loaders show the same images (their resize filters differ pixel by pixel)
    assert abs(default.mean() - default_ref.mean()) < 0.05
    assert abs(tight.mean() - tight_ref.mean()) < 0.05


@pytest.mark.parametrize("policy", ["ta_wide", "ra"])
def test_auto_augment_runs_in_the_pipeline_and_resumes_bitwise(run, tiny_data, tmp_path, policy):
    """--auto-augment in DALI's pipeline (conditional execution): the crops change, and a run
    interrupted mid-epoch resumes exactly, the augmentation's draws included (DALI's
    checkpoint)."""
    samples = scan_folder(tiny_data).train[:16]
    plain = epoch(loader(samples, seed=3))[0][0]
    augmented = epoch(loader(samples, seed=3, auto_augment=policy))[0][0]
    assert augmented.shape == plain.shape and not torch.equal(augmented, plain)
    assert torch.equal(epoch(loader(samples, seed=3, auto_augment=policy))[0][0], augmented)
    common = ["--data", tiny_data, *FAST, "--loader", "dali", "--dali-threads", "2", "--epochs",
              "1", "--eval-every", "0", "--log-every", "2", "--auto-augment", policy]  # fmt: skip
    assert_exact_resume(run, common, tmp_path, steps=12)
