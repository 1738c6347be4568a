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


def _scan_split(split_dir: Path, classes: list[str], exclude: set[str]) -> list[tuple[str, int]]:
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        class_dir = split_dir / name
        if not class_dir.is_dir():
            continue
        files = sorted(
            e.path
            for e in os.scandir(class_dir)
            if e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS)
        )
        if not files:
            raise UserError(
                f"--data: class folder {class_dir} holds no images "
                f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder"
            )
        samples.extend((f, label) for f in files if os.path.abspath(f) not in exclude)
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
    classes = sorted(e.name for e in os.scandir(root / "train") if e.is_dir())
    if not classes:
        raise UserError(f"--data {root}/train: no class folders; expected train/<class>/<image>")
    extra = sorted({e.name for e in os.scandir(root / "val") if e.is_dir()} - set(classes))
    if extra:
        raise UserError(
            f"--data {root}/val: class folders not in train/: {', '.join(extra[:5])}; "
            "val classes must be a subset of train classes"
        )
    train = _scan_split(root / "train", classes, exclude)
    val = _scan_split(root / "val", classes, exclude)
    if not val:
        raise UserError(f"--data {root}/val: no class folders with images")
    return FolderDataset(root, classes, train, val)
