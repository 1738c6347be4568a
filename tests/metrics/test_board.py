"""A profiled run's entries in TensorBoard's Text and Images dashboards (``metrics/board.py``):
unit tests on made-up ranks, and the real thing in a headless Chromium over a profiled CPU run,
with no host but 127.0.0.1 reachable (``tests/browser.py``)."""

from __future__ import annotations

import importlib.util
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from fasttrain.metrics.board import (
    RankProfile,
    breakdown_markdown,
    gaps_markdown,
    kernels_markdown,
    write,
)
from fasttrain.metrics.gaps import Gaps
from fasttrain.metrics.kernels import KernelSplit
from tests.browser import Browser, find_chromium


def made_up(rank: int, idle: float) -> RankProfile:
    mean = {"step": -1, "total": 30.0 + idle, "compute": 27.0, "comm_exposed": 2.0}
    mean |= {"memory_exposed": 1.0, "idle": idle, "comm": 6.0, "memory": 1.5}
    mean |= {"host_loader_wait": 20.0, "host_copy_in": 0.4, "host_sync": 0.0}
    kernels = KernelSplit(
        5,
        {"convolution": 60.0, "Triton (BN, elementwise)": 70.0, "NCCL": 30.0},
        {"triton_red_fused_bn_0": 40.0, "sm90_xmma_fprop|x": 35.0, "ncclDevKernel_AllReduce": 30.0},
    )
    trace = f"profile/rank{rank}.1.pt.trace.json"
    pairs = {("copies and fills", "convolution"): (480, 1500.0)}
    pairs[("convolution", "GEMM (cuBLAS)")] = (90, 45.0)
    gaps = Gaps(5, pairs, {"1-2 µs": (90, 45.0), "2-5 µs": (480, 1500.0)}, (5, 20.0))
    return RankProfile(rank, [trace], mean, "gpu", kernels, gaps)


def test_the_breakdown_table_has_a_row_per_rank_in_rank_order():
    text = breakdown_markdown([made_up(1, 10.0), made_up(0, 0.0)])
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| rank |"))
    assert "host: loader wait | host: copy to device | host: sync calls | trace |" in lines[header]
    assert lines[header + 1].count("---") == lines[header].count("|") - 1
    row0, row1 = lines[header + 2], lines[header + 3]
    assert row0.startswith("| 0 | 30.00 | 27.00 (90%) | 2.00 (7%) | 1.00 (3%) | 0.00 (0%) |")
    assert row1.startswith("| 1 | 40.00 |") and "| 10.00 (25%) |" in row1
    assert row0.endswith("| 20.00 | 0.40 | 0.00 | `profile/rank0.1.pt.trace.json` |")
    empty = breakdown_markdown([RankProfile(2, [], None, "gpu")]).splitlines()[-1]
    assert empty.startswith("| 2 | no profiled steps |") and empty.endswith("| none |")
    assert empty.count("|") == row0.count("|")


def test_top_kernels_per_rank_with_their_class_and_share():
    text = kernels_markdown([made_up(0, 0.0)])
    assert "**rank 0**" in text and "32.00 ms of GPU work per step over 5 profiled steps" in text
    assert "| Triton (BN, elementwise) | 14.00 | 43.8% |" in text
    assert "| `triton_red_fused_bn_0` | Triton (BN, elementwise) | 8.000 |" in text
    assert "| `sm90_xmma_fprop/x` | convolution | 7.000 |" in text  # a | would break the row
    cpu = kernels_markdown([RankProfile(0, [], {}, "cpu")])
    assert "No GPU kernels in the profiled steps (a CPU run)" in cpu


def test_only_the_longest_kernels_travel_between_ranks():
    many = made_up(0, 0.0)
    many.kernels.by_name |= {f"k{i}": 0.1 for i in range(100)}
    small = many.compact()
    assert len(small.kernels.by_name) == 10 and small.kernels.by_class == many.kernels.by_class
    assert "triton_red_fused_bn_0" in small.kernels.by_name


def test_idle_gaps_per_rank_by_length_and_neighbours():
    text = gaps_markdown([made_up(1, 0.0), made_up(0, 0.0)])
    assert text.index("**rank 0**") < text.index("**rank 1**")
    assert "0.309 ms idle per step in 114 gaps" in text
    assert "| 2-5 µs | 96.0 | 0.300 |" in text
    assert "| copies and fills | convolution | 96.0 | 0.300 | 3.12 |" in text
    cpu = gaps_markdown([RankProfile(0, [], {}, "cpu")])
    assert "No GPU kernels in the profiled steps (a CPU run)" in cpu


def test_only_the_idlest_neighbour_pairs_travel_between_ranks():
    many = made_up(0, 0.0)
    many.gaps.by_pair |= {(f"a{i}", "b"): (1, 0.01) for i in range(100)}
    small = many.compact().gaps
    assert len(small.by_pair) == 10 and ("copies and fills", "convolution") in small.by_pair
    assert small.idle_ms() == many.gaps.idle_ms()  # the totals come from every gap


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n", png[:8]
    return struct.unpack(">II", png[16:24])


def test_the_entries_land_in_tensorboards_event_file(tmp_path):
    pytest.importorskip("matplotlib", reason="the profile extra: pip install -e .[profile]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    write(writer, 42, [made_up(0, 0.0), made_up(1, 10.0)])
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert events.Tags()["images"] == ["profile/step_parts"]
    (image,) = events.Images("profile/step_parts")
    assert image.step == 42 and image.width > image.height > 100
    assert _png_size(image.encoded_image_string) == (image.width, image.height)
    text = events.Tensors("profile/breakdown/text_summary")[0].tensor_proto.string_val[0]
    assert b"| 1 | 40.00 |" in text
    gaps = events.Tensors("profile/idle_gaps/text_summary")[0].tensor_proto.string_val[0]
    assert b"| copies and fills | convolution |" in gaps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tensorboard(profiled_cpu_run, tmp_path):
    """TensorBoard on 127.0.0.1 over the profiled run; its URL. Killed by its PID after."""
    out, done = profiled_cpu_run
    assert done.returncode == 0, done.stderr
    port = _free_port()
    log = (tmp_path / "tensorboard.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(out), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "0"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "tensorboard.log").read_text()) from None
                time.sleep(0.5)
        yield url
    finally:
        server.kill()
        server.wait(timeout=30)
        log.close()


@pytest.mark.slow
@pytest.mark.browser
def test_a_browser_without_internet_shows_the_breakdown_and_its_picture(tensorboard, tmp_path):
    """What a user on an air-gapped cluster sees: TensorBoard's Text dashboard shows the
    breakdown table and the top kernels, and its Images dashboard loads the picture."""
    exe = find_chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium)")
    browser = Browser(exe, tmp_path / "chromium")
    try:
        browser.open(f"{tensorboard}/#text")
        # the markdown's own tables (TensorBoard sets each text entry in a table of its own)
        tables = browser.wait_for(
            "table", "el => el.innerText", lambda v: any(t.startswith("rank\t") for t in v)
        )
        browser.screenshot(tmp_path / "text.png")
        breakdown = next((t for t in tables if t.startswith("rank\tstep")), None)
        assert breakdown is not None, f"no breakdown table in the Text dashboard: {tables}"
        header, row = breakdown.splitlines()[:2]
        assert header.split("\t")[-4:] == [
            "host: loader wait",
            "host: copy to device",
            "host: sync calls",
            "trace",
        ]
        assert header.split("\t")[:3] == ["rank", "step", "compute"]
        assert row.split("\t")[0] == "0" and "profile/rank0." in row
        shown = browser.deep("*", "el => el.shadowRoot ? '' : el.innerText || ''")
        assert any("No GPU kernels in the profiled steps" in t for t in shown)

        browser.open(f"{tensorboard}/#images")
        images = browser.wait_for(
            "img",
            "el => [el.src, el.naturalWidth, el.naturalHeight]",
            lambda v: any(w > 0 and "individualImage" in src for src, w, _ in v),
        )
        png = browser.screenshot(tmp_path / "images.png")
        loaded = [(src, w, h) for src, w, h in images if "individualImage" in src and w > 0]
        assert loaded, f"the picture did not load in the Images dashboard: {images}"
        src, width, height = loaded[0]
        assert width > height > 100
        served = urllib.request.urlopen(src, timeout=10).read()
        assert _png_size(served) == (width, height)
        assert _png_size(png)[0] > 0
    finally:
        browser.close()
    assert browser.proc.returncode is not None


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_each_have_a_row_and_a_bar(tiny_data, tmp_path):
    """``--nproc-per-node 2 --profile`` over gloo: the main process writes both ranks' rows,
    kernels and bars, gathered after the loop."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import FAST

    out = tmp_path / "two"
    flags = ["--profile", "--profile-wait", "1", "--profile-warmup", "1", "--profile-active", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "fasttrain", "--nproc-per-node", "2", "--data", str(tiny_data),
         *FAST, "--batch-size", "8", "--max-steps", "5", "--eval-every", "0",
         "--output-dir", str(out), *flags],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    text = events.Tensors("profile/breakdown/text_summary")[0].tensor_proto.string_val[0].decode()
    rows = [line for line in text.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert [r[:5] for r in rows] == ["| 0 |", "| 1 |"], text
    assert "profile/rank1." in rows[1]
    kernels = events.Tensors("profile/top_kernels/text_summary")[0].tensor_proto.string_val[0]
    assert b"**rank 0**" in kernels and b"**rank 1**" in kernels
    if importlib.util.find_spec("matplotlib"):
        assert events.Tags()["images"] == ["profile/step_parts"]
    assert sorted(p.name for p in (out / "profile").glob("breakdown-rank*.json")) == [
        "breakdown-rank0.json",
        "breakdown-rank1.json",
    ]
