"""bench/report.py turns pytest-benchmark JSON into the BENCHMARKS.md table and chart."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_report", Path(__file__).parent.parent / "bench" / "report.py"
)
report = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(report)


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


def test_epoch_rates_leave_out_the_first_epoch_and_then_each_epoch_start(tmp_path):
    """bench/epoch_rates.py on a hand-made run: batch 100, epochs of 20 steps logged every 10;
    the interval that begins each epoch takes 2 s, the others 1 s (95 ms per step of it inside
    the step: 5 ms outside, its steps' spread 0.3 and 0.4 ms: 0.354 pooled)."""
    spec = importlib.util.spec_from_file_location(
        "epoch_rates", Path(__file__).parent.parent / "bench" / "epoch_rates.py"
    )
    epoch_rates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(epoch_rates)
    lines = []
    for step in range(10, 61, 10):
        epoch = (step - 1) // 20
        seconds = 2.0 if step % 20 == 10 else 1.0
        gpu = 150.0 if step % 20 == 10 else 95.0
        sd = 9.0 if step % 20 == 10 else 0.3 if step < 50 else 0.4
        lines.append(
            {
                "kind": "train",
                "step": step,
                "epoch": epoch,
                "img_per_s": 1000 / seconds,
                "gpu_step_ms": gpu,
                "gpu_step_ms_sd": sd,
            }
        )
    lines.insert(3, {"kind": "val", "step": 20, "epoch": 0, "top1": 50.0})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    (tmp_path / "summary.json").write_text(json.dumps({"global_batch": 100}))
    got = epoch_rates.rates(tmp_path)
    # epochs 1 and 2: two epoch starts (2 s each) and two in-epoch intervals (1 s each)
    assert got["steady_img_per_s"] == pytest.approx(4000 / 6)
    assert got["in_epoch_img_per_s"] == pytest.approx(1000.0)
    # the in-epoch intervals' 100 ms per step: 95 inside the step, 5 outside
    assert got["wall_ms_per_step"] == pytest.approx(100.0)
    assert got["gpu_step_ms"] == pytest.approx(95.0)
    assert got["outside_step_ms"] == pytest.approx(5.0)
    assert got["gpu_step_sd_ms"] == pytest.approx(math.sqrt((0.3**2 + 0.4**2) / 2))
    # the same run as its printed log: the trainer's line format, the same figures
    log = tmp_path / "run.txt"
    log.write_text(
        "device cuda:0, amp bf16 | global batch 100 (100 per GPU x 1 GPU(s) x 1 accum) | x\n"
        + "".join(
            f"epoch {r['epoch']} step {r['step']}: loss 0.5 top1 90.0% lr 0.1 "
            f"{r['img_per_s']:,.0f} img/s data-wait 0% gpu {r['gpu_step_ms']:.1f} ms/step "
            f"(sd {r['gpu_step_ms_sd']:.2f}), idle 5.0%\n"
            for r in lines
            if r["kind"] == "train"
        )
        + "epoch 0 val: top1 50.0% top5 90.0%\n"
    )
    assert epoch_rates.rates(log) == got
    # and as a rank's log file, each line after its time and level
    rank_log = tmp_path / "log-rank0.txt"
    stamp = "2026-11-30 20:34:01,304 INFO "
    rank_log.write_text("".join(stamp + line + "\n" for line in log.read_text().splitlines()))
    assert epoch_rates.rates(rank_log) == got
    (tmp_path / "summary.json").unlink()  # a failed run: reported, not a traceback
    out = subprocess.run(
        [sys.executable, str(Path(spec.origin)), str(tmp_path), str(log)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert json.loads(out[0]) == {"run": tmp_path.name, "failed": True}
    assert json.loads(out[1])["in_epoch_img_per_s"] == pytest.approx(1000.0)


def test_clocks_takes_the_medians_of_the_samples_inside_each_window(tmp_path, capsys):
    """bench/clocks.py on an nvidia-smi log in the format the H200 machine wrote (eighth
    session): only samples inside a window count, unreadable values are skipped, and the
    clock-limit reasons are counted."""
    spec = importlib.util.spec_from_file_location(
        "clocks", Path(__file__).parent.parent / "bench" / "clocks.py"
    )
    clocks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clocks)
    rows = []
    for i in range(30):  # one sample per second from 17:26:00; the clock drops at 17:26:20
        clock, watts = (1950, 690) if i < 20 else (1800, 600)
        reason = "0x0000000000000004" if i % 5 else "0x0000000000000000"
        rows.append(f"2026/11/30 17:26:{i:02d}.122, {clock} MHz, {watts}.50 W, 53, {reason}")
    rows[3] = "2026/11/30 17:26:03.122, [N/A], [N/A], 53, 0x0000000000000004"
    rows.append("not a sample")
    (tmp_path / "smi.csv").write_text("\n".join(rows) + "\n")
    marks = [
        {
            "variant": "first",
            "start": "2026/11/30 17:26:01.000000",
            "end": "2026/11/30 17:26:10.000000",
        },
        {
            "variant": "second",
            "start": "2026/11/30 17:26:20.000000",
            "end": "2026/11/30 17:26:29.500000",
        },
        {
            "variant": "empty",
            "start": "2026/11/30 18:00:00.000000",
            "end": "2026/11/30 18:00:01.000000",
        },
    ]
    (tmp_path / "marks.jsonl").write_text("".join(json.dumps(m) + "\n" for m in marks))
    clocks.main(str(tmp_path / "smi.csv"), str(tmp_path / "marks.jsonl"))
    table = {
        line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()
    }
    assert table["first"].startswith("| first | 9 | 1,950 | 690 | 53 | 0x0000000000000004 x8, ")
    assert "0x0000000000000000 x1" in table["first"]  # second 5 and 10 would be two; 10 is out
    assert table["second"].startswith("| second | 10 | 1,800 | 600 | 53 | ")
    assert table["empty"] == "| empty | 0 | | | | |"


def test_dali_e2e_trace_summary_lists_the_loader_work_by_kernel(tmp_path, capsys, monkeypatch):
    """bench/dali_e2e.py's trace summary on a hand-made chrome trace of two steps: the busiest
    stream is the training stream; everything else is listed per kernel name, per step."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "bench"))
    spec = importlib.util.spec_from_file_location(
        "dali_e2e", Path(__file__).parent.parent / "bench" / "dali_e2e.py"
    )
    dali_e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dali_e2e)

    def k(name, stream, ts, dur, cat="kernel"):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"stream": stream},
        }

    events = [k("conv", 7, 0, 30_000), k("conv", 7, 30_000, 30_000)]  # two 30 ms steps
    events += [k("rgba2rgb", s, 1_000 + 100 * s, 250) for s in (20, 21, 22, 23)]
    events += [k("Memcpy HtoD", 20, 5_000, 400, cat="gpu_memcpy"), k("resize", 13, 9_000, 600)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    dali_e2e.summarize(str(path), steps=2)
    out = capsys.readouterr().out
    assert "off the training stream (7)" in out
    section = out.split("off the training stream (7)")[1].split("host sync/wait")[0]
    listed = section.splitlines()[1:]
    assert [line.split()[2] for line in listed] == ["rgba2rgb", "resize", "Memcpy"]
    assert listed[0].split()[:2] == ["0.500", "2.0"]  # 4 x 0.25 ms over 2 steps
    assert listed[1].split()[:2] == ["0.300", "0.5"]
