"""The built-in sample dataset: a JPEG ImageFolder that a fresh machine can train on.

Each class is a shape with its own colour and stripe texture, drawn at a random place, size and
angle over a noisy gradient background, so the classes are learnable but not trivially so. Images
are ImageNet-like in size (300-480 x 360-700) and compression (JPEG quality 90, about 100 KB), so
the decoder works as hard as on real data. Building is deterministic for a given spec and seed, runs
in parallel, and is atomic: a half-built folder is never mistaken for a finished one.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageDraw
from tqdm import tqdm

SHAPES = (
    "circle",
    "square",
    "triangle",
    "diamond",
    "cross",
    "star",
    "ring",
    "hexagon",
    "bar",
    "crescent",
)


@dataclass(frozen=True)
class SampleSpec:
    classes: int = 10
    train_per_class: int = 1000
    val_per_class: int = 50
    min_side: int = 300  # height range; width is 4/3 of it, as in typical ImageNet photos
    max_side: int = 480
    quality: int = 90
    seed: int = 0
    # smaller objects of other classes drawn under each image's own, which a model must learn to
    # tell from it (0: none, the demo's set)
    clutter: int = 0

    @property
    def name(self) -> str:
        # bump v1 when the drawing changes, so old caches are not reused
        return (
            f"sample-v1-c{self.classes}-t{self.train_per_class}-v{self.val_per_class}"
            f"-s{self.min_side}-{self.max_side}-q{self.quality}-seed{self.seed}"
            + (f"-x{self.clutter}" if self.clutter else "")
        )


# A harder set than the demo's, whose top-1 stays well below 100% in a short run: 100 classes
# (the 10 shapes in 10 colours and stripe widths each, told apart by hue and texture), each image
# with three smaller objects of other classes beneath its own, at 224-320 px
HARD = SampleSpec(
    classes=100, train_per_class=150, val_per_class=20, min_side=224, max_side=320, clutter=3
)


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    def ring(n: int, radius_fn, phase: float = 0.0):
        return [
            (
                cx + radius_fn(i) * math.cos(angle + phase + 2 * math.pi * i / n),
                cy + radius_fn(i) * math.sin(angle + phase + 2 * math.pi * i / n),
            )
            for i in range(n)
        ]

    if kind == "square":
        return ring(4, lambda i: r, math.pi / 4)
    if kind == "triangle":
        return ring(3, lambda i: r)
    if kind == "diamond":
        return ring(4, lambda i: r if i % 2 == 0 else r * 0.55)
    if kind == "star":
        return ring(10, lambda i: r if i % 2 == 0 else r * 0.45)
    if kind == "hexagon":
        return ring(6, lambda i: r)
    if kind == "cross":
        w = r * 0.35
        pts = [
            (-w, -r),
            (w, -r),
            (w, -w),
            (r, -w),
            (r, w),
            (w, w),
            (w, r),
            (-w, r),
            (-w, w),
            (-r, w),
            (-r, -w),
            (-w, -w),
        ]
    elif kind == "bar":
        w = r * 0.3
        pts = [(-r, -w), (r, -w), (r, w), (-r, w)]
    else:
        raise ValueError(kind)
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def _class_style(label: int) -> tuple[str, np.ndarray, float]:
    """Shape, base colour and stripe period of a class (past 10 classes, shapes repeat)."""
    shape = SHAPES[label % len(SHAPES)]
    hue = (label * 0.61803398875) % 1.0  # golden-ratio hues stay far apart
    rgb = np.array([0.5 + 0.5 * math.cos(2 * math.pi * (hue + k / 3)) for k in range(3)])
    period = 6.0 + 4.0 * (label % 4)
    return shape, rgb * 235 + 10, period


def render(label: int, rng: np.random.Generator, spec: SampleSpec) -> Image.Image:
    """Draw one image of class ``label``."""
    h = int(rng.integers(spec.min_side, spec.max_side + 1))
    w = int(h * rng.uniform(1.2, 1.45))
    # Background: a random gradient (a 2x2 image stretched bilinearly) plus Gaussian noise. The
    # noise keeps the JPEG as large as a photo's. PIL's C routines keep a 500x660 image near 10 ms.
    corners = rng.integers(0, 256, (2, 2, 3), dtype=np.uint8)
    img = Image.fromarray(corners).resize((w, h), Image.BILINEAR)
    img = ImageChops.add(img, _noise(w, h, 18, rng), offset=-128)
    for _ in range(spec.clutter):  # other classes' objects, smaller, beneath the image's own
        other = (label + int(rng.integers(1, spec.classes))) % spec.classes
        _draw(img, other, rng.uniform(0.08, 0.16) * min(h, w), rng)
    _draw(img, label, rng.uniform(0.18, 0.4) * min(h, w), rng)
    return img


def _draw(img: Image.Image, label: int, r: float, rng: np.random.Generator) -> None:
    """Paste an object of class ``label``, of radius ``r``, at a random place and angle: a
    class-specific shape, filled with its class colour and stripes."""
    w, h = img.size
    shape, rgb, period = _class_style(label)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    angle = rng.uniform(0, 2 * math.pi)
    # everything below works in the object's bounding box; polygon corners reach past r (a cross's
    # arm corners sit at 1.06 r), so the box has a margin
    m = 1.1 * r
    x0, y0 = max(0, int(cx - m)), max(0, int(cy - m))
    bw, bh = min(w, int(cx + m) + 2) - x0, min(h, int(cy + m) + 2) - y0
    lx, ly = cx - x0, cy - y0
    mask = Image.new("L", (bw, bh), 0)
    draw = ImageDraw.Draw(mask)
    box = (lx - r, ly - r, lx + r, ly + r)
    if shape == "circle":
        draw.ellipse(box, fill=255)
    elif shape == "ring":
        draw.ellipse(box, fill=255)
        k = r * 0.55
        draw.ellipse((lx - k, ly - k, lx + k, ly + k), fill=0)
    elif shape == "crescent":
        draw.ellipse(box, fill=255)
        dx, dy = 0.45 * r * math.cos(angle), 0.45 * r * math.sin(angle)
        draw.ellipse((lx - r + dx, ly - r + dy, lx + r + dx, ly + r + dy), fill=0)
    else:
        draw.polygon(_polygon(shape, lx, ly, r, angle), fill=255)
    yy = np.arange(bh, dtype=np.float32)[:, None]
    xx = np.arange(bw, dtype=np.float32)[None, :]
    shade = 0.875 + 0.125 * np.sin(
        (xx * math.cos(angle) + yy * math.sin(angle)) * (2 * math.pi / period)
    )
    colour = (rgb * rng.uniform(0.8, 1.1)).astype(np.float32)
    obj = Image.fromarray(np.clip(shade[..., None] * colour, 0, 255).astype(np.uint8))
    obj = ImageChops.add(obj, _noise(bw, bh, 12, rng), offset=-128)
    img.paste(obj, (x0, y0), mask)


def _noise(w: int, h: int, sigma: float, rng: np.random.Generator) -> Image.Image:
    """RGB Gaussian noise centred on 128. PIL's generator is not seedable, so draw a small seeded
    tile with numpy and stretch it: deterministic, and fine-grained enough to cost JPEG bits."""
    tile = rng.normal(128, sigma, (h // 2 + 1, w // 2 + 1, 3)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(tile).resize((w, h), Image.NEAREST)


def _write_chunk(args: tuple[str, SampleSpec, str, int, int, int]) -> int:
    root, spec, split, label, start, count = args
    folder = Path(root) / split / f"class_{label:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    split_id = 0 if split == "train" else 1
    for i in range(start, start + count):
        rng = np.random.default_rng([spec.seed, split_id, label, i])
        render(label, rng, spec).save(
            folder / f"{split}_{label:03d}_{i:05d}.jpg", quality=spec.quality
        )
    return count


def build_sample(
    root: Path,
    spec: SampleSpec = SampleSpec(),
    workers: int | None = None,
    log=print,
    bar: bool = False,
) -> Path:
    """Build ``root/spec.name`` once (train/ and val/); return its path. Safe to call repeatedly.
    ``bar``: a progress bar on a terminal (the build takes a minute or more on a small machine)."""
    dest = Path(root) / spec.name
    if (dest / "DONE").exists():
        return dest
    Path(root).mkdir(parents=True, exist_ok=True)
    tmp = Path(root) / f".{spec.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    total = spec.classes * (spec.train_per_class + spec.val_per_class)
    log(
        f"building the sample dataset ({total:,} JPEGs, {spec.classes} classes) in {dest}; "
        "this happens once"
    )
    jobs = []
    for split, per in (("train", spec.train_per_class), ("val", spec.val_per_class)):
        for label in range(spec.classes):
            for start in range(0, per, 100):
                jobs.append((str(tmp), spec, split, label, start, min(100, per - start)))
    workers = workers or len(os.sched_getaffinity(0))
    progress = tqdm(
        total=total,
        unit="JPEG",
        desc="sample dataset",
        dynamic_ncols=True,
        disable=not (bar and sys.stderr.isatty()),
        file=sys.stderr,
    )
    pool = ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext()
    with progress, pool:
        done = 0
        for written in pool.map(_write_chunk, jobs) if workers > 1 else map(_write_chunk, jobs):
            done += written
            progress.update(written)
    assert done == total
    (tmp / "DONE").write_text(f"{asdict(spec)}\n")
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "DONE").exists():
            raise
    return dest
