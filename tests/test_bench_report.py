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
    "bench_report", Path(__file__).parent.parent / "bench" / "report.py"
)
report = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(report)
E2E = importlib.util.spec_from_file_location(
    "bench_e2e", Path(__file__).parent.parent / "bench" / "e2e.py"
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
            b("kernels: normalize", "test_normalize[triton]", GB_per_s=3100.5, us_per_call=49.0),
            b("kernels: SGD", "test_sgd[triton]", us_per_call=210.0),
            b("misc", "test_without_a_figure"),
        ],
    }


def test_rows_pick_each_benchmarks_figure():
    assert report.rows(bench_json()) == [
        ("loaders", "test_dali[0.99-8]", "img_per_s", 24243.0),
        ("kernels: normalize", "test_normalize[triton]", "GB_per_s", 3100.5),
        ("kernels: SGD", "test_sgd[triton]", "us_per_call", 210.0),
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
        and "| loaders | test_dali[0.99-8] | img_per_s | 24,243.0 |" in text
    )
    if "--png" in argv:
        assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    else:
        pytest.skip("matplotlib is not installed: table only")


def test_e2e_runs_the_cli_side_by_side_and_writes_its_table(tiny_data, tmp_path):
    """bench/e2e.py on the CPU, with tiny flags: a synthetic run with the JPEG set's steps per
    epoch beside a torchvision one, their summaries, and the table that compares them."""
    out = tmp_path / "e2e"
    flags = [*FAST, "--epochs", "2", "--log-every", "4", "--eval-every", "0"]
    done = subprocess.run(
        [sys.executable, "bench/e2e.py", "--data", str(tiny_data), "--loaders",
         "synthetic,torchvision", "--repeat", "1", "--out", str(out), "--", *flags],
        cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = [json.loads(line) for line in (out / "summaries.jsonl").read_text().splitlines()]
    assert [(r["loader"], r["exit"], r["steps"]) for r in runs] == [
        ("synthetic", 0, 24),  # 192 images // 16: 12 steps per epoch, as the JPEG set gives
        ("torchvision", 0, 24),
    ]
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
