"""bench/kernel_bandwidth.py joins a trace's kernel times with inductor's byte estimates."""

import importlib.util
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_kernel_bandwidth", Path(__file__).parents[2] / "bench" / "kernel_bandwidth.py"
)
bw = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = bw  # its dataclass looks its module up
SPEC.loader.exec_module(bw)


def source(name: str, gb: float) -> str:
    """A kernel's source as inductor writes it with TORCHINDUCTOR_BENCHMARK_KERNEL=1 (the parts
    read here: the decorator's inductor_meta on one line, then the def)."""
    return (
        "import triton\n\n@triton_heuristics.pointwise(\n    size_hints={'x': 1048576},\n"
        "    filename=__file__,\n    triton_meta={'signature': {'in_ptr0': '*fp16'}},\n"
        "    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': "
        f"'{name}', 'mutated_arg_names': [], 'kernel_num_gb': {gb!r}, 'kernel_flop': 0}},\n"
        "    min_elem_per_thread=0\n)\n@triton.jit\n"
        f"def {name}(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):\n    pass\n"
    )


def kernel(name: str, corr: int, us: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": 1000, "dur": us, "args": {"correlation": corr}}


def trace() -> dict:
    def step(n, ts):
        return {"cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts, "dur": 100}

    def launch(corr, ts):
        return {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
                "args": {"correlation": corr}}  # fmt: skip

    return {
        "traceEvents": [
            step(3, 0), launch(1, 10), step(4, 200), launch(2, 210),
            kernel("triton_poi_fused_add_0", 1, 100.0),  # 0.4 GB in 100 µs: 4 TB/s
            kernel("triton_poi_fused_add_0", 2, 100.0),
            kernel("triton_red_fused_sum_1", 1, 200.0),  # 0.2 GB in 200 µs: 1 TB/s
            kernel("triton_red_fused_sum_1", 2, 200.0),
            kernel("triton_poi_fused_relu_2", 1, 50.0),  # ambiguous: two estimates
            kernel("triton_poi_fused_relu_2", 2, 50.0),
            kernel("triton_poi_fused_add_0", 9, 999.0),  # launched before the profiled steps
            kernel("sm90_xmma_fprop_implicit_gemm", 1, 500.0),  # not inductor's
        ]
    }  # fmt: skip


@pytest.fixture
def sources(tmp_path):
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "cab1.py").write_text(source("triton_poi_fused_add_0", 0.4))
    (tmp_path / "ab" / "cab2.py").write_text(source("triton_red_fused_sum_1", 0.2))
    (tmp_path / "cd").mkdir()
    (tmp_path / "cd" / "ccd1.py").write_text(source("triton_poi_fused_relu_2", 0.1))
    (tmp_path / "cd" / "ccd2.py").write_text(source("triton_poi_fused_relu_2", 0.3))
    # a graph's wrapper embeds the same sources again: the same estimate, not ambiguous
    (tmp_path / "cd" / "wrapper.py").write_text(
        "triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', '''\n"
        + source("triton_poi_fused_add_0", 0.4)
        + "''', device_str='cuda')\n"
    )
    return tmp_path


def test_estimates_from_the_sources_with_ambiguous_names_left_out(sources):
    estimates, ambiguous = bw.kernel_bytes([sources])
    assert estimates == {
        "triton_poi_fused_add_0": pytest.approx(0.4e9),
        "triton_red_fused_sum_1": pytest.approx(0.2e9),
    }
    assert ambiguous == {"triton_poi_fused_relu_2"}


def test_rates_per_step_and_the_summary(sources):
    estimates, _ = bw.kernel_bytes([sources])
    kernels = bw.rates(trace(), estimates)
    assert [k.name for k in kernels] == [
        "triton_red_fused_sum_1",
        "triton_poi_fused_add_0",
        "triton_poi_fused_relu_2",
    ]
    by = {k.name: k for k in kernels}
    assert by["triton_poi_fused_add_0"].calls == 1 and by["triton_poi_fused_add_0"].us == 100
    assert by["triton_poi_fused_add_0"].tb_per_s() == pytest.approx(4.0)
    assert by["triton_red_fused_sum_1"].tb_per_s() == pytest.approx(1.0)
    assert by["triton_poi_fused_relu_2"].tb_per_s() is None
    lines = bw.summary(kernels, at_tb_s=4.0)
    # 0.6 GB in 300 µs: 2 TB/s; at 4 TB/s the sum kernel would take 50 µs, 150 less
    assert "0.60 GB, **2.00 TB/s** on average" in lines[0]
    assert "would take 0.15 ms less per step" in lines[1]
    rows = bw.table(kernels, top=2)
    assert len(rows) == 4 and "| 1 | 200.0 | 200.0 | 1.00 |" in rows[2]
