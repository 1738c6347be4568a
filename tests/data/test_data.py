import shutil
from pathlib import Path

import pytest
import torch
import torchvision.transforms.functional as F
from PIL import Image

from fasttrain.data.check import read_exclude_list
from fasttrain.data.folder import scan_folder
from fasttrain.data.synthetic import SyntheticLoader
from fasttrain.data.torchvision import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFolderDataset,
    TrainSampler,
    ValSampler,
)
from tests.conftest import FAST, train_loader


def flat(batches):
    return [pair for batch in batches for pair in batch]


def test_train_sampler_shards_are_disjoint_equal_and_batch_aligned():
    shards = [list(TrainSampler(103, r, 2, seed=0, batch_at=lambda e: 8)) for r in range(2)]
    assert all(len(b) == 8 for s in shards for b in s)
    idx = [[i for i, _ in flat(s)] for s in shards]
    assert len(idx[0]) == len(idx[1]) == 48  # 51 per rank -> 6 full batches
    assert not set(idx[0]) & set(idx[1])
    assert all(epoch == 0 for _, epoch in flat(shards[0]))


def test_train_sampler_reshuffles_per_epoch_and_resumes_mid_epoch():
    s = TrainSampler(64, 0, 1, seed=3, batch_at=lambda e: 4)
    s.set_position(1, 0)
    full = list(s)
    s.set_position(1, 5)
    assert list(s) == full[5:]
    assert len(s) == len(full) - 5
    s.set_position(2, 0)
    assert [i for i, _ in flat(s)] != [i for i, _ in flat(full)]


def test_train_sampler_batches_each_epoch_at_its_own_size_in_the_same_order():
    """A per-epoch batch regroups the epoch's samples: the same order, other batch edges."""
    fixed = TrainSampler(64, 0, 1, seed=3, batch_at=lambda e: 4)
    mixed = TrainSampler(64, 0, 1, seed=3, batch_at=lambda e: 16 if e == 1 else 4)
    for epoch, size, count in ((0, 4, 16), (1, 16, 4)):
        fixed.set_position(epoch, 0)
        mixed.set_position(epoch, 0)
        got = list(mixed)
        assert [len(b) for b in got] == [size] * count and mixed.full_batches(epoch) == count
        assert flat(got) == flat(fixed)


def test_val_sampler_covers_every_image_exactly_once_across_ranks():
    seen = [i for r in range(3) for i, _ in ValSampler(10, r, 3)]
    assert sorted(seen) == list(range(10))


def test_augmentation_is_keyed_on_seed_epoch_and_index(tiny_data):
    ds = ImageFolderDataset(scan_folder(tiny_data).train, train=True, image_size=32, seed=1)
    a, la, _ = ds[(5, 0)]
    b, lb, _ = ds[(5, 0)]
    c, _, _ = ds[(5, 1)]
    assert torch.equal(a, b) and la == lb
    assert not torch.equal(a, c)
    assert a.shape == (32, 32, 3) and a.dtype == torch.uint8  # HWC: batches collate to NHWC


def test_val_transform_is_resize_then_center_crop(tiny_data):
    samples = scan_folder(tiny_data).val
    ds = ImageFolderDataset(samples, train=False, image_size=32, seed=0)
    x, label, bad = ds[(0, 0)]
    with Image.open(samples[0][0]) as im:
        ref = F.pil_to_tensor(F.center_crop(F.resize(im.convert("RGB"), 37, antialias=True), 32))
    assert torch.equal(x, ref.permute(1, 2, 0)) and label == samples[0][1] and bad == ""


@pytest.fixture
def data_with_bad_files(tmp_path, tiny_data):
    root = tmp_path / "d"
    shutil.copytree(tiny_data, root)
    ds = scan_folder(root)
    bad_train = ds.train[3][0]
    bad_val = ds.val[2][0]
    Path(bad_train).write_bytes(b"\xff\xd8\xff not a jpeg")  # corrupt
    Path(bad_val).write_bytes(b"")  # zero bytes
    return root, bad_train, bad_val


def test_bad_train_image_is_replaced_without_shifting_labels(data_with_bad_files):
    root, bad_train, _ = data_with_bad_files
    samples = scan_folder(root).train
    ds = ImageFolderDataset(samples, train=True, image_size=32, seed=0)
    x, label, bad = ds[(3, 0)]
    assert bad == bad_train
    substitute = (3 + 7919) % len(samples)
    assert label == samples[substitute][1]  # the label of the image actually returned
    ref, ref_label, _ = ds[(substitute, 0)]
    assert ref_label == label and x.shape == ref.shape


def test_bad_val_image_is_masked_and_counted(data_with_bad_files):
    root, _, bad_val = data_with_bad_files
    ds = ImageFolderDataset(scan_folder(root).val, train=False, image_size=32, seed=0)
    _, label, bad = ds[(2, 0)]
    assert label == -1 and bad == bad_val


def test_device_loader_normalises_on_the_device_and_warns_once(data_with_bad_files, caplog):
    root, bad_train, _ = data_with_bad_files
    samples = scan_folder(root).train
    loader = train_loader(samples, batch_size=8)
    assert len(loader) == len(samples) // 8
    loader.set_epoch(0)
    batches = list(loader)
    assert len(batches) == len(loader)
    x, y = batches[0]
    assert x.shape == (8, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)
    assert y.dtype == torch.int64
    # the same samples through the plain torchvision Normalize give the same tensor
    ds = loader.loader.dataset
    keys = next(iter(loader.sampler))  # the first batch's (index, epoch) keys
    raw = torch.stack([ds[k][0] for k in keys]).permute(0, 3, 1, 2).float() / 255
    ref = F.normalize(raw, IMAGENET_MEAN, IMAGENET_STD)
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
    assert loader.bad_files == {bad_train}
    assert sum("undecodable" in r.message for r in caplog.records) == 1


def test_synthetic_loader_has_fixed_tensors_and_resumes():
    loader = SyntheticLoader(
        batch_size=4,
        image_size=16,
        num_classes=10,
        steps=5,
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        channels_last=True,
        seed=0,
    )
    loader.set_epoch(0, 3)
    batches = list(loader)
    assert len(batches) == 2 and len(loader) == 5
    x, y = batches[0]
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
    assert batches[1][0].data_ptr() == x.data_ptr()
    assert int(y.max()) < 10


def test_check_data_lists_bad_files_and_training_leaves_them_out(
    run, tiny_data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    train_dir, val_dir = data / "train" / "class_000", data / "val" / "class_003"
    good = sorted(train_dir.iterdir())
    truncated = good[0].read_bytes()
    bad = {
        good[1]: b"",  # zero bytes
        good[2]: b"\xff\xd8\xff\xe0 corrupt",  # a JPEG header, then nothing
        good[3]: truncated[: len(truncated) // 3],  # cut off part-way
        sorted(val_dir.iterdir())[0]: b"plain text, named .jpg",  # not an image
    }
    for path, content in bad.items():
        path.write_bytes(content)
    png = good[4]  # a PNG named .jpg, and a grayscale image: both decodable, both kept
    Image.open(good[5]).save(png, format="PNG")
    Image.open(good[6]).convert("L").save(good[6], format="JPEG")

    from fasttrain.__main__ import main

    capsys.readouterr()
    assert main(["check-data", str(data), "--workers", "2"]) == 0
    out, err = capsys.readouterr()
    listed = {line.split("\t")[0] for line in out.splitlines()}
    assert listed == {str(p) for p in bad}
    assert "4 of 292 images failed to decode" in err
    from fasttrain.config.paths import default_exclude_list

    assert read_exclude_list(default_exclude_list(data)) == {str(p) for p in bad}

    # training on that --data finds the list and leaves the files out: no undecodable warnings
    code, err = run("--data", data, *FAST, "--epochs", "1", "--output-dir", tmp_path / "o")
    assert code == 0, err
    log = (tmp_path / "o" / "log-rank0.txt").read_text()
    assert "leaving out the 4 files" in log and "undecodable" not in log
    assert run.records(tmp_path / "o", "val")[-1]["images"] == 99


@pytest.mark.parametrize("policy", ["ta_wide", "ra"])
def test_auto_augment_in_the_torchvision_loader_is_seeded_per_sample(tiny_data, policy):
    """torchvision's TrivialAugment / RandAugment on each crop, drawn from the sample's own
    seed: the same (seed, epoch, index) gives the same image, in any worker, in any order."""
    from fasttrain.data.torchvision import ImageFolderDataset

    samples = scan_folder(tiny_data).train[:8]
    plain = ImageFolderDataset(samples, True, 32, seed=0)
    aug = ImageFolderDataset(samples, True, 32, seed=0, auto_augment=policy)
    again = ImageFolderDataset(samples, True, 32, seed=0, auto_augment=policy)
    first = [aug[(i, 1)][0] for i in range(8)]
    backwards = {i: again[(i, 1)][0] for i in reversed(range(8))}  # another order
    assert all(torch.equal(first[i], backwards[i]) for i in range(8))
    assert any(not torch.equal(a, plain[(i, 1)][0]) for i, a in enumerate(first))
    assert all(a.shape == (32, 32, 3) and a.dtype == torch.uint8 for a in first)


@pytest.mark.gpu
def test_torchvision_loader_copies_without_syncing(tiny_data):
    samples = scan_folder(tiny_data).train
    loader = train_loader(samples, workers=2, device="cuda", dtype=torch.bfloat16)
    loader.set_epoch(0)
    n = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # after construction: only iteration is steady state
    try:
        for x, y in loader:
            assert x.is_cuda and x.dtype == torch.bfloat16 and y.dtype == torch.int64
            assert x.is_contiguous(memory_format=torch.channels_last)
            n += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert n == len(loader)
