"""bench/report.py turns pytest-benchmark JSON into the BENCHMARKS.md table and chart;
bench/e2e.py compares end-to-end runs."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST

SPEC = importlib.util.spec_from_file_location(
    "bench_report", Path(__file__).parents[2] / "bench" / "report.py"
)
report = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(report)
E2E = importlib.util.spec_from_file_location(
    "bench_e2e", Path(__file__).parents[2] / "bench" / "e2e.py"
)
e2e = importlib.util.module_from_spec(E2E)
E2E.loader.exec_module(e2e)


def bench_json() -> dict:
    def b(group, name, **info):
        return {"group": group, "name": name, "extra_info": info, "stats": {"median": 1.0}}

    return {
        "machine_info": {"node": "gpu-host"},
        "commit_info": {"id": "abcdef123456"},
        "datetime": "2026-11-30",
        "benchmarks": [
            b("loaders", "test_dali[0.99-8]", img_per_s=24243.0),
            b("step paths", "test_step_path[fp16-256]", img_per_s=8000.0, peak_gib=9.25),
            b("kernels: normalize", "test_normalize[triton]", GB_per_s=3100.5, us_per_call=49.0),
            b("kernels: SGD", "test_sgd[triton]", us_per_call=210.0),
            b("misc", "test_without_a_figure"),
        ],
    }


def test_rows_pick_each_benchmarks_figure():
    assert report.rows(bench_json()) == [
        ("loaders", "test_dali[0.99-8]", "img_per_s", 24243.0, None),
        ("step paths", "test_step_path[fp16-256]", "img_per_s", 8000.0, 9.25),
        ("kernels: normalize", "test_normalize[triton]", "GB_per_s", 3100.5, None),
        ("kernels: SGD", "test_sgd[triton]", "us_per_call", 210.0, None),
    ]


def test_table_and_chart(tmp_path, monkeypatch, capsys):
    path = tmp_path / "out.json"
    path.write_text(json.dumps(bench_json()))
    argv = ["report.py", str(path)]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--png", str(tmp_path / "b.png")]
    monkeypatch.setattr("sys.argv", argv)
    report.main()
    text = capsys.readouterr().out
    assert (
        "commit abcdef1" in text
        and "| loaders | test_dali[0.99-8] | img_per_s | 24,243.0 |  |" in text
        and "| step paths | test_step_path[fp16-256] | img_per_s | 8,000.0 | 9.2 |" in text
    )
    if "--png" in argv:
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    else:
        pytest.skip("matplotlib is not installed: table only")


def test_e2e_runs_the_cli_side_by_side_and_writes_its_table(tiny_data, tmp_path):
    """bench/e2e.py on the CPU, with tiny flags: a synthetic run with the JPEG set's steps per
    epoch beside a torchvision one, each also with a variant's flag added, their summaries, and
    the table that compares them."""
    out = tmp_path / "e2e"
    flags = [*FAST, "--epochs", "2", "--log-every", "4", "--eval-every", "0"]
    done = subprocess.run(
        [sys.executable, "bench/e2e.py", "--data", str(tiny_data), "--loaders",
         "synthetic,torchvision", "--repeat", "1", "--variant", "fused=--fused-bn", "--out",
         str(out), "--", *flags],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = [json.loads(line) for line in (out / "summaries.jsonl").read_text().splitlines()]
    assert [(r["tree"], r["loader"], r["exit"], r["steps"]) for r in runs] == [
        ("this", "synthetic", 0, 24),  # 192 images // 16: 12 steps per epoch, as the set gives
        ("this", "torchvision", 0, 24),
        ("this fused", "synthetic", 0, 24),
        ("this fused", "torchvision", 0, 24),
    ]
    assert ["--fused-bn" in r["cmd"] for r in runs] == [False, False, True, True]
    assert all(r["img_per_s_per_gpu"] > 0 for r in runs)
    table = (out / "e2e.md").read_text()
    assert table == done.stdout.strip() + "\n"
    assert "fasttrain imported from this: " in table
    row = next(line for line in table.splitlines() if "| torchvision |" in line)
    assert row.startswith("| this | torchvision | 1 | ") and "%" in row.split("|")[6]


def test_e2e_table_compares_with_synthetic_and_one_gpu():
    runs = [
        {"tree": "this", "loader": "synthetic", "gpus": 1, "img_per_s_per_gpu": 1000.0},
        {"tree": "this", "loader": "dali", "gpus": 1, "img_per_s_per_gpu": 980.0},
        {"tree": "this", "loader": "dali", "gpus": 2, "img_per_s_per_gpu": 931.0},
        {"tree": "this", "loader": "dali", "gpus": 2, "exit": 1},
    ]
    lines = e2e.table(runs).splitlines()
    assert lines[3] == "| this | dali | 1 | 980 | 980 | -2.0% |  |"
    assert lines[4] == "| this | dali | 2 | 931 | 931 |  | 95.0% |"


SPLIT = importlib.util.spec_from_file_location(
    "bench_kernel_split", Path(__file__).parents[2] / "bench" / "kernel_split.py"
)
kernel_split = importlib.util.module_from_spec(SPLIT)
SPLIT.loader.exec_module(kernel_split)


def test_kernel_split_classifies_a_traces_kernels_per_step(tmp_path, monkeypatch, capsys):
    def k(name, us, cat="kernel"):
        return {"cat": cat, "name": name, "dur": us}

    trace = {
        "traceEvents": [
            {"cat": "user_annotation", "name": "ProfilerStep#4"},
            {"cat": "user_annotation", "name": "ProfilerStep#5"},
            k("triton_red_fused__native_batch_norm_legit_functional_0", 3000),
            k("triton_poi_fused_add_relu_1", 1000),
            k("sm90_xmma_fprop_implicit_gemm_f16f16_f32f32", 2000),
            k("sm90_xmma_gemm_f16f16_f32", 400),
            k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 500),
            k("Memcpy DtoD (Device -> Device)", 100, cat="gpu_memcpy"),
            k("void at::native::vectorized_elementwise_kernel", 1000),
            {"cat": "cpu_op", "name": "aten::conv2d", "dur": 9999},  # host work: not counted
        ]
    }
    steps, by_class, _ = kernel_split.split(trace)
    assert steps == 2
    assert by_class == {
        "inductor / Triton": 4.0,
        "convolution (cuDNN)": 2.0,
        "matmul (cuBLAS)": 0.4,
        "communication (NCCL)": 0.5,
        "copies and fills": 0.1,
        "other kernels": 1.0,
    }
    path = tmp_path / "rank0.1.pt.trace.json.gz"
    import gzip

    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    monkeypatch.setattr("sys.argv", ["kernel_split.py", str(path), "--top", "2"])
    kernel_split.main()
    text = capsys.readouterr().out
    assert "2 profiled steps, 4.00 ms of GPU work per step" in text
    assert "| inductor / Triton | 2.00 | 50.0% |" in text


def test_kernel_split_leaves_out_kernels_launched_before_the_profiled_steps():
    """The host runs ahead of the GPU: a graphed step's trace also records the replay launched
    before profiling began, still running. Counted, it inflated every per-step figure by a third
    (four replays' kernels divided by three steps)."""

    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
                "args": {"correlation": corr}}  # fmt: skip

    def kernel(name, corr, ts, us):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": us,
                "args": {"correlation": corr}}  # fmt: skip

    def step(n, ts):
        return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts,
                "dur": 100}  # fmt: skip

    trace = {
        "traceEvents": [
            launch(7, 50),  # the replay before profiling began (its launch may be missing too)
            step(2, 200),
            launch(8, 210),
            step(3, 300),
            launch(9, 310),
            kernel("triton_poi_fused_add_relu_1", 7, 400, 1000),
            kernel("triton_poi_fused_add_relu_1", 6, 1400, 1000),  # launched before the trace
            kernel("triton_poi_fused_add_relu_1", 8, 2400, 1000),
            kernel("sm90_xmma_fprop_implicit_gemm", 8, 3400, 2000),
            kernel("triton_poi_fused_add_relu_1", 9, 5400, 1000),
            kernel("sm90_xmma_fprop_implicit_gemm", 9, 6400, 2000),
        ]
    }
    steps, by_class, by_name = kernel_split.split(trace)
    assert steps == 2
    assert by_class == {"inductor / Triton": 2.0, "convolution (cuDNN)": 4.0}
    assert by_name["triton_poi_fused_add_relu_1"] == 2.0
    for e in trace["traceEvents"]:  # without correlation ids every kernel counts
        e.pop("args", None)
    assert kernel_split.split(trace)[1] == {"inductor / Triton": 4.0, "convolution (cuDNN)": 4.0}


def test_e2e_makes_the_paths_it_hands_the_trainer_absolute(tmp_path, monkeypatch):
    """Runs start in their output directory: a recipe named relative to the caller's would not
    be found there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text("train: {}\n")
    got = e2e.absolute_paths(["--config", "r.yaml", "--epochs", "8", "--data=r.yaml", "--resume",
                              "auto"])  # fmt: skip
    assert got == ["--config", str(tmp_path / "r.yaml"), "--epochs", "8",
                   f"--data={tmp_path / 'r.yaml'}", "--resume", "auto"]  # fmt: skip


def test_variants_only_leaves_the_plain_flags_out():
    given = ["plain=--no-fused-bn", "fused=--fused-bn on"]
    assert e2e.parse_variants(given, only=False) == [
        ("", []),
        ("plain", ["--no-fused-bn"]),
        ("fused", ["--fused-bn", "on"]),
    ]
    assert e2e.parse_variants(given, only=True)[0] == ("plain", ["--no-fused-bn"])
