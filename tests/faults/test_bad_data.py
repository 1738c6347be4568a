"""Bad data: folders a loader cannot use are one line; images that do not decode are found by
check-data, skipped by the torchvision loader and named by DALI, and never shift a label."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fasttrain.__main__ import main
from tests.conftest import FAST, make_tree, train_loader
from tests.faults.conftest import copy_data, one_line_error


@pytest.mark.parametrize(
    "files, flag_text",
    [
        (None, "--data {d}: no such directory"),
        ([], "--data {d}: the directory is empty"),
        (["val/a/x.jpg"], "--data {d}: no train/ folder"),
        (["train/a/x.jpg"], "--data {d}: no val/ folder"),
        (
            ["train/a/x.jpg", "train/b/notes.txt", "val/a/x.jpg"],
            "class folder {d}/train/b holds no",
        ),
        (["train/a/x.jpg", "val/c/y.jpg"], "class folders not in train/: c"),
    ],
)
def test_bad_data_folders(run, tmp_path, files, flag_text):
    d = tmp_path / "data"
    if files is not None:
        d.mkdir()
        make_tree(d, files)
    code, err = run("--data", d, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert flag_text.format(d=d) in one_line_error(err)


@pytest.mark.parametrize("where", ["file", "class folder"])
def test_a_symlink_loop_in_the_data_is_one_line(run, tiny_data, tmp_path, where):
    data = copy_data(tiny_data, tmp_path)
    link = data / "train" / "class_000" / "loop.jpg" if where == "file" else data / "train" / "x"
    link.symlink_to(link.name)  # points at itself
    code, err = run("--data", data, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert one_line_error(err) == (
        f"fasttrain: error: --data: cannot read {link} (Too many levels of symbolic links); "
        "fix it (permissions, links) or move it out of the dataset"
    )


def test_an_unreadable_class_folder_is_one_line(run, tiny_data, tmp_path, monkeypatch):
    """(Permissions cannot be taken from root, which CI runs as: the refusal is simulated.)"""
    import errno

    data = copy_data(tiny_data, tmp_path)
    locked = data / "val" / "class_001"
    scandir = os.scandir

    def refuse(path="."):
        if os.fspath(path) == os.fspath(locked):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(locked))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refuse)
    code, err = run("--data", data, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert f"cannot read {locked} (Permission denied)" in one_line_error(err)


def test_a_single_class_dataset_is_refused(run, tiny_data, tmp_path):
    import shutil

    data = copy_data(tiny_data, tmp_path)
    for split in ("train", "val"):
        for extra in sorted((data / split).iterdir())[1:]:
            shutil.rmtree(extra)
    code, err = run("--data", data, *FAST, "--output-dir", tmp_path / "out")
    assert code == 2
    assert one_line_error(err) == (
        f"fasttrain: error: --data {data}/train: one class folder (class_000); a classifier "
        "needs at least two classes"
    )


def test_batch_larger_than_the_dataset(run, tiny_data, tmp_path):
    code, err = run(
        "--data",
        tiny_data,
        *FAST[:-6],
        "--batch-size",
        "1000",
        "--device",
        "cpu",
        "--output-dir",
        tmp_path / "o",
    )
    assert code == 2 and "--batch-size 1000" in one_line_error(err)


def test_corrupt_images_do_not_stop_a_run(run, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    bad = [
        next((data / "train" / "class_001").iterdir()),
        next((data / "val" / "class_002").iterdir()),
    ]
    bad[0].write_bytes(b"\xff\xd8\xff\xe0 truncated")
    bad[1].write_bytes(b"")
    out = tmp_path / "out"
    code, err = run("--data", data, *FAST, "--epochs", "1", "--output-dir", out)
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert str(bad[0]) in log and str(bad[1]) in log and "undecodable" in log
    assert run.records(out, "val")[-1]["images"] == 99  # one val image skipped, none counted twice


def test_a_class_whose_every_image_fails_is_named(run, tiny_data, tmp_path):
    """The torchvision loader skips bad files one by one; when a whole class is gone it says
    so, by name. With check-data's list the run refuses to start instead."""
    data = copy_data(tiny_data, tmp_path)
    for path in (data / "train" / "class_002").iterdir():
        path.write_bytes(b"not an image")
    code, err = run(
        "--data", data, *FAST, "--loader", "torchvision", "--workers", "0", "--epochs", "1",
        "--eval-every", "0", "--output-dir", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    log = (tmp_path / "o" / "log-rank0.txt").read_text()
    assert "every image of class class_002 (48 files) failed to decode" in log

    listed = tmp_path / "bad.json"
    assert (
        main(["check-data", str(data), "--workers", "1", "--no-dali", "--output", str(listed)]) == 0
    )
    code, err = run("--data", data, *FAST, "--exclude-list", listed, "--output-dir", tmp_path / "p")
    assert code == 2
    assert (
        f"every image in class folder {data}/train/class_002 is on the exclusion list"
        in one_line_error(err)
    )


def test_both_loaders_apply_exif_orientation(tmp_path):
    """A phone photo stored sideways with an EXIF orientation tag: the torchvision loader and
    DALI see the picture a viewer shows (left half red turned to the top half here)."""
    import numpy as np
    import torch
    from PIL import Image

    from fasttrain.data.folder import scan_folder

    pytest.importorskip("nvidia.dali")
    from fasttrain.data.dali import build_dali_loader
    from fasttrain.data.torchvision import build_torchvision_loader

    pixels = np.zeros((64, 96, 3), np.uint8)
    pixels[:, :48, 0] = 255  # left half red, right half blue
    pixels[:, 48:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display"
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(pixels).save(tmp_path / split / c / "photo.jpg", exif=exif)
    samples = scan_folder(tmp_path).val
    common = dict(train=False, image_size=32, batch_size=2, seed=0, rank=0, world=1,
                  device=torch.device("cpu"), channels_last=True)  # fmt: skip
    tv = build_torchvision_loader(samples, workers=0, dtype=torch.float32, **common)
    dali = build_dali_loader(samples, threads=1, hw_decoder_load=0.99, **common)
    for loader in (tv, dali):
        loader.set_epoch(0)
        x, _ = next(iter(loader))
        red = x[0, 0].float()
        assert red[:12].mean() > 1 and red[-12:].mean() < -1, type(loader).__name__
        assert abs(red[:, :12].mean() - red[:, -12:].mean()) < 0.2, type(loader).__name__


def odd_images(root: Path) -> dict[str, str]:
    """Every kind of file a real photo folder holds, one per name: what each should become."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)

    def rgb(w=96, h=80):
        return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))

    for d in ("train/a", "train/b", "val/a", "val/b"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for c in "ab":
        for i in range(4):
            rgb().save(root / f"train/{c}/ok{i}.jpg")
        rgb().save(root / f"val/{c}/v.jpg")
    rgb().convert("L").save(root / "train/a/gray.jpg")
    rgb().convert("CMYK").save(root / "train/a/cmyk.jpg")
    sixteen = (rng.integers(0, 256, (80, 96)) * 257).astype(np.uint16)  # mid-grey on average
    Image.fromarray(sixteen).save(root / "train/b/sixteen.png")
    rgb().save(root / "train/b/png_named.jpg", format="PNG")
    Image.new("RGB", (10000, 10000), (90, 120, 200)).save(root / "train/b/huge.jpg", quality=50)
    tga = io.BytesIO()
    rgb().save(tga, format="TGA")
    (root / "train/a/tga_named.jpg").write_bytes(tga.getvalue())  # PIL reads it, DALI does not
    (root / "train/a/text.jpg").write_text("not an image at all\n")
    (root / "train/b/zero.jpg").write_bytes(b"")
    buf = io.BytesIO()
    rgb().save(buf, format="JPEG")
    (root / "train/a/truncated.jpg").write_bytes(buf.getvalue()[:200])
    return {
        "gray.jpg": "converted",
        "cmyk.jpg": "converted",
        "sixteen.png": "converted",
        "png_named.jpg": "converted",
        "huge.jpg": "converted",
        "tga_named.jpg": "converted",
        "text.jpg": "skipped",
        "zero.jpg": "skipped",
        "truncated.jpg": "skipped",
    }


@pytest.fixture(scope="module")
def odd_data(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("odd")
    return root, odd_images(root)


@pytest.mark.slow
def test_torchvision_loader_converts_odd_images_and_skips_broken_ones(odd_data):
    from fasttrain.data.folder import scan_folder
    from fasttrain.data.torchvision import ImageFolderDataset

    root, expect = odd_data
    samples = scan_folder(root).train
    ds = ImageFolderDataset(samples, train=False, image_size=32, seed=0)
    for index, (path, label) in enumerate(samples):
        name = Path(path).name
        x, got_label, bad = ds[(index, 0)]
        assert x.shape == (32, 32, 3), name
        if expect.get(name) == "skipped":  # val-style: counted, label -1, never another's label
            assert got_label == -1 and bad == path, name
        else:
            assert got_label == label and bad == "", name
        if name == "sixteen.png":  # scaled to 8 bits, not clipped to white
            assert 60 < x.float().mean() < 200
    loader = train_loader(samples, batch_size=4)
    loader.set_epoch(0)
    batches = list(loader)
    assert len(batches) == len(samples) // 4
    skipped = {Path(p).name for p in loader.bad_files}
    assert skipped == {n for n, what in expect.items() if what == "skipped"}


@pytest.mark.slow
def test_dali_decodes_every_odd_image_once_check_data_listed_the_broken(odd_data, tmp_path):
    pytest.importorskip("nvidia.dali")
    from fasttrain.data.check import find_bad_files, find_dali_rejects
    from fasttrain.data.dali import build_dali_loader
    from fasttrain.data.folder import scan_folder

    root, expect = odd_data
    _, bad = find_bad_files(root, workers=2)
    assert {Path(p).name for p, _ in bad} == {n for n, w in expect.items() if w == "skipped"}
    # the second pass: what PIL read, through DALI's own decoder (as check-data runs it)
    rejected = {p for p, _ in bad}
    scanned = scan_folder(root)
    good = [p for p, _ in scanned.train + scanned.val if p not in rejected]
    dali_bad = find_dali_rejects(good, threads=2)
    assert [Path(p).name for p, _ in dali_bad] == ["tga_named.jpg"]
    assert "DALI's decoder rejects it" in dali_bad[0][1]
    samples = scan_folder(root, rejected | {p for p, _ in dali_bad}).train
    indexed = [(path, i) for i, (path, _) in enumerate(samples)]
    loader = build_dali_loader(
        indexed,
        train=False,
        image_size=32,
        batch_size=4,
        threads=2,
        hw_decoder_load=0.99,
        seed=0,
        rank=0,
        world=1,
        device=torch.device("cpu"),
        channels_last=True,
    )
    loader.set_epoch(0)
    seen = torch.cat([y.clone() for _, y in loader])
    assert sorted(seen[seen >= 0].tolist()) == list(range(len(samples)))  # each decoded once


def test_check_data_lists_any_file_name_and_dali_then_trains_past_it(run, tiny_data, tmp_path):
    """A zero-byte file whose name holds a newline: check-data's list names it exactly (one JSON
    document), and the DALI loader, which would stop on it, trains past it."""

    pytest.importorskip("nvidia.dali")
    from fasttrain.__main__ import main
    from fasttrain.data.check import read_exclude_list

    data = copy_data(tiny_data, tmp_path)
    odd = data / "train" / "class_001" / "bad\nname.jpg"
    odd.write_bytes(b"")
    listed = tmp_path / "bad.json"
    assert main(["check-data", str(data), "--workers", "1", "--output", str(listed)]) == 0
    document = json.loads(listed.read_text())
    assert [f["path"] for f in document["files"]] == [str(odd)]
    assert read_exclude_list(listed) == {str(odd)}
    code, err = run(
        "--data", data, *FAST, "--loader", "dali", "--dali-threads", "1", "--max-steps", "3",
        "--eval-every", "0", "--exclude-list", listed, "--output-dir", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err
    assert "leaving out the 1 files" in (tmp_path / "o" / "log-rank0.txt").read_text()


def test_a_hand_written_exclusion_list_is_one_path_per_line(tmp_path):
    from fasttrain.data.check import read_exclude_list

    listed = tmp_path / "skip.txt"
    listed.write_text("# broken ones\n/data/a.jpg\n\n/data/b c.jpg\n")
    assert read_exclude_list(listed) == {"/data/a.jpg", "/data/b c.jpg"}


def test_dalis_reader_failing_on_a_zero_byte_file_is_one_line_naming_it(run, tiny_data, tmp_path):
    pytest.importorskip("nvidia.dali")
    data = copy_data(tiny_data, tmp_path)
    empty = data / "train" / "class_001" / "zero.jpg"
    empty.write_bytes(b"")
    code, err = run(
        "--data", data, *FAST, "--loader", "dali", "--dali-threads", "1", "--epochs", "1",
        "--eval-every", "0", "--output-dir", tmp_path / "o",
    )  # fmt: skip
    assert code == 1, err
    assert one_line_error(err).startswith(
        f"fasttrain: error: --loader dali: DALI cannot read {empty} (File mapping failed); run "
        "`python -m fasttrain check-data DIR` once"
    )
