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


def test_kernel_split_prints_a_gzipped_traces_tables(tmp_path, monkeypatch, capsys):
    import gzip

    from tests.metrics.test_kernels import two_steps

    path = tmp_path / "rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(two_steps(), f)
    monkeypatch.setattr("sys.argv", ["kernel_split.py", str(path), "--top", "2"])
    kernel_split.main()
    text = capsys.readouterr().out
    assert "2 profiled steps, 4.00 ms of GPU work per step" in text
    assert "| Triton (BN, elementwise) | 2.00 | 50.0% |" in text
    assert text.count("| `") == 2


START = importlib.util.spec_from_file_location(
    "bench_startup", Path(__file__).parents[2] / "bench" / "startup.py"
)
startup_bench = importlib.util.module_from_spec(START)
START.loader.exec_module(startup_bench)


def test_startup_rows_name_the_largest_parts_and_the_caches():
    summary = {
        "img_per_s": 8865.2,
        "startup": {
            "total_s": 38.44,
            "parts_s": {"AOT autograd": 11.9, "dynamo trace": 6.8, "data": 0.4, "model": 3.7},
            "fx_graph_cache": {"hits": 2, "misses": 0},
            "aot_autograd_cache": {"hit": 0, "miss": 0, "bypass": 2},
        },
    }
    line = startup_bench.row("fused", "warm", summary)
    assert line == (
        "| fused | warm | 38.4 | AOT autograd 11.9, dynamo trace 6.8, model 3.7, data 0.4 | "
        "FX 2/2, AOT 0/2 | 8,865 |"
    )
    assert startup_bench.row("fused", "cold", {"exit": 1}) == (
        "| fused | cold | failed (exit 1) | | | |"
    )
