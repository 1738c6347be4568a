import io
import os

import numpy as np
from PIL import Image

from fasttrain.data.folder import scan_folder
from fasttrain.data.sample import SampleSpec, build_sample, render
from tests.conftest import TINY


def test_builds_an_imagefolder_with_train_and_val(tiny_data):
    ds = scan_folder(tiny_data)
    assert ds.classes == [f"class_{i:03d}" for i in range(TINY.classes)]
    assert len(ds.train) == TINY.classes * TINY.train_per_class
    assert len(ds.val) == TINY.classes * TINY.val_per_class
    labels = [label for _, label in ds.train]
    assert np.bincount(labels).tolist() == [TINY.train_per_class] * TINY.classes
    for path, _ in ds.val[:: TINY.val_per_class]:
        with Image.open(path) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert TINY.min_side <= im.height <= TINY.max_side
            assert im.width > im.height


def test_build_is_deterministic_and_done_once(tmp_path, tiny_data):
    spec = SampleSpec(classes=2, train_per_class=3, val_per_class=2, min_side=40, max_side=48)
    a = build_sample(tmp_path / "a", spec, workers=1, log=lambda m: None)
    b = build_sample(tmp_path / "b", spec, workers=2, log=lambda m: None)
    files = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(files) == 2 * (3 + 2)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    stamp = os.stat(a / files[0]).st_mtime_ns
    messages = []
    assert build_sample(tmp_path / "a", spec, log=messages.append) == a
    assert messages == []  # nothing rebuilt
    assert os.stat(a / files[0]).st_mtime_ns == stamp
    assert not list((tmp_path / "a").glob(".*tmp*"))  # no half-built folder left behind


def test_default_images_are_imagenet_like():
    spec = SampleSpec()
    sizes = []
    for label in range(spec.classes):
        img = render(label, np.random.default_rng([9, label]), spec)
        assert spec.min_side <= img.height <= spec.max_side
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=spec.quality)
        sizes.append(len(buf.getvalue()))
    # ImageNet's train JPEGs average about 110 KB; stay in that range so decode cost is realistic
    assert 60_000 < np.mean(sizes) < 200_000


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_build_shows_a_progress_bar_on_a_terminal_only(tmp_path, monkeypatch):
    spec = SampleSpec(classes=2, train_per_class=3, val_per_class=2, min_side=40, max_side=48)
    for terminal, path in ((True, "t"), (False, "f")):
        err = _Terminal() if terminal else io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        build_sample(tmp_path / path, spec, workers=1, log=lambda m: None, bar=True)
        assert ("sample dataset: 100%" in err.getvalue() and "10/10" in err.getvalue()) == terminal
