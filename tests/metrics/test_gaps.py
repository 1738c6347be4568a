"""The idle gaps inside a trace's profiled steps (``fasttrain.metrics.gaps``), which
``bench/kernel_split.py`` shows: by the work on either side and by length, with the seam
between steps and work launched before profiling left out."""

from __future__ import annotations

import pytest

from fasttrain.metrics.gaps import LONGEST, gaps, length_bin


def launch(corr: int, ts: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
            "args": {"correlation": corr}}  # fmt: skip


def work(name: str, corr: int, ts: float, us: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": us, "args": {"correlation": corr}}


def step(n: int, ts: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts, "dur": 100}


def replay(corr: int, t: float) -> list[dict]:
    """One graphed step's GPU work from ``t``: a Triton kernel, a memset 1.5 µs later, a
    convolution 3 µs after that, then a Triton kernel 30 µs later (a long wait)."""
    return [
        work("triton_poi_fused_add_relu_1", corr, t, 10),
        work("Memset (Device)", corr, t + 11.5, 1, cat="gpu_memset"),
        work("sm90_xmma_fprop_implicit_gemm", corr, t + 15.5, 20),
        work("triton_red_fused_sum_2", corr, t + 65.5, 10),
    ]


def trace() -> dict:
    events = [launch(7, 50), step(2, 200), launch(8, 210), step(3, 300), launch(9, 310)]
    events += [work("triton_poi_fused_add_relu_1", 7, 380, 10)]  # the replay launched before
    events += replay(8, 400) + replay(9, 500)
    return {"traceEvents": events}


def test_gaps_by_neighbours_and_length_per_step():
    g = gaps(trace())
    assert g.steps == 2
    assert g.by_pair == {
        ("Triton (BN, elementwise)", "copies and fills"): (2, pytest.approx(3.0)),
        ("copies and fills", "convolution"): (2, pytest.approx(6.0)),
        ("convolution", "Triton (BN, elementwise)"): (2, pytest.approx(60.0)),
    }
    assert g.by_length["1-2 µs"] == (2, pytest.approx(3.0))
    assert g.by_length["2-5 µs"] == (2, pytest.approx(6.0))
    assert g.by_length[LONGEST] == (2, pytest.approx(60.0))
    assert g.idle_ms() == pytest.approx(0.0345)
    assert g.count() == 3
    # the first step's last kernel ends at 475.5; the second's first starts at 500
    assert g.seams == (1, pytest.approx(24.5))
    text = "\n".join(g.tables(5))
    assert "0.035 ms idle per step in 3 gaps" in text
    assert "| convolution | Triton (BN, elementwise) | 1.0 | 0.030 | 30.00 |" in text


def test_overlapping_work_leaves_no_gap_and_the_later_end_counts():
    t = trace()
    # a second stream's kernel covering the long wait of the first step
    # a second stream's kernel from 430 to 450, overlapping the convolution (415.5 to 435.5)
    t["traceEvents"].append(work("ncclDevKernel_AllReduce", 8, 430, 20))
    g = gaps(t)
    # the wait after it is what nothing covers: 450 to 465.5, after the kernel that ended last
    assert g.by_pair[("NCCL", "Triton (BN, elementwise)")] == (1, pytest.approx(15.5))
    assert g.by_pair[("convolution", "Triton (BN, elementwise)")] == (1, pytest.approx(30.0))


def test_without_correlation_ids_everything_is_one_stretch():
    t = trace()
    for e in t["traceEvents"]:
        e.pop("args", None)
    g = gaps(t)
    assert g.seams == (0, 0.0)
    assert sum(n for n, _ in g.by_pair.values()) == 8  # the early kernel's gap and the seam too


@pytest.mark.parametrize(
    "us, label", [(0.5, "up to 1 µs"), (1.0, "up to 1 µs"), (1.5, "1-2 µs"), (21, LONGEST)]
)
def test_length_bins(us, label):
    assert length_bin(us) == label
