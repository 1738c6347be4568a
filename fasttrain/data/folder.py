"""Scan and validate an ImageNet-style folder (``train/<class>/*.jpg``, ``val/<class>/*.jpg``).

Every loader backend reads the same scan, so a class index means the same thing in all of them.
Problems a user must fix (missing folders, an empty class) become one-line ``UserError``s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fasttrain.errors import UserError

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class FolderDataset:
    root: Path
    classes: list[str]
    train: list[tuple[str, int]]  # (path, label)
    val: list[tuple[str, int]]


def _unreadable(e: OSError) -> UserError:
    """A folder or file the scan cannot read (permissions, a symlink loop), as one line."""
    return UserError(
        f"--data: cannot read {e.filename} ({e.strerror}); fix it (permissions, links) or "
        "move it out of the dataset"
    )


def _is(entry: os.DirEntry, kind: str) -> bool:
    try:
        return entry.is_dir() if kind == "dir" else entry.is_file()
    except OSError as e:  # a symlink loop, an unreadable link target
        raise _unreadable(e) from None


def _list(directory: Path, kind: str) -> list[os.DirEntry]:
    """The entries of ``directory`` that are directories (``kind="dir"``) or files."""
    try:
        with os.scandir(directory) as entries:
            return [e for e in entries if _is(e, kind)]
    except OSError as e:
        raise _unreadable(e) from None


def _scan_split(split_dir: Path, classes: list[str], exclude: set[str]) -> list[tuple[str, int]]:
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        class_dir = split_dir / name
        if not class_dir.is_dir():
            continue
        files = sorted(
            e.path for e in _list(class_dir, "file") if e.name.lower().endswith(IMG_EXTENSIONS)
        )
        if not files:
            raise UserError(
                f"--data: class folder {class_dir} holds no images "
                f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder"
            )
        kept = [(f, label) for f in files if os.path.abspath(f) not in exclude]
        if not kept:
            raise UserError(
                f"--data: every image in class folder {class_dir} is on the exclusion list "
                "(check-data found none of them decodable); fix or remove the folder"
            )
        samples.extend(kept)
    return samples


def scan_folder(root: str | Path, exclude: set[str] | None = None) -> FolderDataset:
    """Read the class list from ``train/`` and the samples of both splits, leaving out the
    ``exclude``d files (absolute paths, from ``check-data``)."""
    exclude = exclude or set()
    root = Path(root)
    if not root.exists():
        raise UserError(
            f"--data {root}: no such directory; point it at a folder with train/ and "
            "val/ inside, or leave --data out to use the built-in sample dataset"
        )
    if not root.is_dir():
        raise UserError(f"--data {root}: not a directory")
    if not any(root.iterdir()):
        raise UserError(
            f"--data {root}: the directory is empty; it needs train/ and val/ class "
            "folders (ImageNet layout)"
        )
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise UserError(
                f"--data {root}: no {split}/ folder; expected {root}/{split}/<class>/"
                "<image>.jpg (ImageNet layout)"
            )
    classes = sorted(e.name for e in _list(root / "train", "dir"))
    if not classes:
        raise UserError(f"--data {root}/train: no class folders; expected train/<class>/<image>")
    extra = sorted({e.name for e in _list(root / "val", "dir")} - set(classes))
    if extra:
        raise UserError(
            f"--data {root}/val: class folders not in train/: {', '.join(extra[:5])}; "
            "val classes must be a subset of train classes"
        )
    if len(classes) < 2:
        raise UserError(
            f"--data {root}/train: one class folder ({classes[0]}); a classifier needs at least "
            "two classes"
        )
    train = _scan_split(root / "train", classes, exclude)
    val = _scan_split(root / "val", classes, exclude)
    if not val:
        raise UserError(f"--data {root}/val: no class folders with images")
    return FolderDataset(root, classes, train, val)


def scan_eval_folder(root: str | Path, exclude: set[str] | None = None) -> FolderDataset:
    """What ``evaluate`` reads: ``root/val`` with the class list of ``root/train`` (the layout
    training uses), or, without ``train/``, ``root``'s own class folders, in sorted order as
    torchvision's ImageFolder numbers them. The samples are the dataset's ``val``."""
    root = Path(root)
    if (root / "train").is_dir():
        return scan_folder(root, exclude)
    if not root.is_dir():
        raise UserError(f"--data {root}: no such directory")
    classes = sorted(e.name for e in _list(root, "dir") if e.name != "val")
    if (root / "val").is_dir() and not classes:
        classes = sorted(e.name for e in _list(root / "val", "dir"))
        root = root / "val"
    if not classes:
        raise UserError(
            f"--data {root}: no class folders; give a dataset root with val/ (and train/), or "
            "a folder of <class>/<image> folders"
        )
    val = _scan_split(root, classes, exclude or set())
    if not val:
        raise UserError(f"--data {root}: no images in its class folders")
    return FolderDataset(root, classes, [], val)
