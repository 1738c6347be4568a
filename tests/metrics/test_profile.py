"""The step-time breakdown on hand-made traces with known parts, and a profiled CPU run whose
traces TensorBoard's profiler plugin and the breakdown both read."""

from __future__ import annotations

import importlib.util
import json

import pytest

from fasttrain.metrics.breakdown import PARTS, step_times, summarize
from tests.conftest import FAST

US = 1.0  # trace timestamps are microseconds


def cpu(name: str, cat: str, ts: float, dur: float, **args) -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 100,
        "tid": 1,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def gpu_event(name: str, ts: float, dur: float, corr: int, cat: str = "kernel", stream: int = 7):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"device": 0, "stream": stream, "correlation": corr},
    }


def gpu(name: str, cat: str, ts: float, dur: float, launched: float, stream: int = 7):
    """A GPU event and the host call that launched it (same correlation id), as Kineto writes."""
    corr = int(ts * 10 + stream)
    launch = cpu("cudaLaunchKernel", "cuda_runtime", launched, 2, correlation=corr)
    return [launch, gpu_event(name, ts, dur, corr, cat, stream)]


def hand_made_trace() -> dict:
    """Three steps of known composition (times in us). Host windows [0, 1000), [1000, 2000),
    [2000, 3000); a step's GPU window runs from the previous one's end to the end of the last
    GPU work launched in its host window.

    step 1, GPU window [0, 700): compute [100, 400) and [600, 700); NCCL [300, 500) on another
    stream, 100 of it under compute; memcpy [50, 120), 50 of it alone; host data wait [0, 30); a
    stream synchronize [900, 950); the copy to the device [18, 30) inside the data wait, and
    a copy into the graph's inputs [600, 620) outside it. So compute 400, NCCL exposed 100,
    memcpy alone 50, idle 150; the host waited 18 for the loader and copied for 12.
    step 2, GPU window [700, 1960): three kernels launched by a graph replay back to back
    [1000, 1900), a memset alone [1950, 1960). So compute 900, memory alone 10, idle 350.
    step 3 launches nothing: its window runs on to its host window's end, [1960, 3000), idle.
    A kernel launched after the last step [3500, 3600) belongs to no step.
    """
    events = [
        cpu("ProfilerStep#1", "user_annotation", 0, 1000),
        cpu("ProfilerStep#2", "user_annotation", 1000, 1000),
        cpu("ProfilerStep#3", "user_annotation", 2000, 1000),  # HTA drops the last iteration
        cpu("fasttrain.data", "user_annotation", 0, 30),
        cpu("fasttrain.copy_in", "user_annotation", 18, 12),  # the loader's copy to the device
        cpu("fasttrain.copy_in", "user_annotation", 600, 20),  # the graph's inputs: not data
        cpu("cudaStreamSynchronize", "cuda_runtime", 900, 50),
        *gpu("sm90_xmma_gemm_bf16", "kernel", 100, 300, launched=35),
        *gpu("triton_poi_fused_relu_0", "kernel", 600, 100, launched=40),
        *gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 300, 200, 45, stream=20),
        *gpu("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 50, 70, launched=31, stream=21),
        # step 2: a graph replay's kernels, all from one launch
        *gpu("cudnn_conv_fwd", "kernel", 1000, 300, launched=1001),
        *gpu("triton_red_fused_bn_1", "kernel", 1300, 300, launched=1002),
        *gpu("void at::native::vectorized_elementwise_kernel", "kernel", 1600, 300, 1003),
        *gpu("Memset (Device)", "gpu_memset", 1950, 10, launched=1004, stream=21),
        *gpu("triton_poi_late", "kernel", 3500, 100, launched=3400),  # after the last step
    ]
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0}, "traceEvents": events}


def test_breakdown_classifies_a_hand_made_trace_exactly():
    s1, s2, s3 = step_times(hand_made_trace())
    assert (s1.step, s2.step, s3.step) == (1, 2, 3)
    assert s3.compute == 0 and s3.total == s3.idle == pytest.approx(1.04)
    assert s1.total == pytest.approx(0.7) and s2.total == pytest.approx(1.26)
    assert s1.compute == pytest.approx(0.4)
    assert s1.comm == pytest.approx(0.2) and s1.comm_exposed == pytest.approx(0.1)
    assert s1.memory == pytest.approx(0.07) and s1.memory_exposed == pytest.approx(0.05)
    assert s1.idle == pytest.approx(0.15)
    assert s1.host_loader_wait == pytest.approx(0.018) and s1.host_copy_in == pytest.approx(0.012)
    assert s1.host_sync == pytest.approx(0.05) and s2.host_copy_in == s2.host_loader_wait == 0
    assert s2.compute == pytest.approx(0.9) and s2.memory_exposed == pytest.approx(0.01)
    assert s2.idle == pytest.approx(0.35) and s2.comm == 0


def test_steps_are_timed_on_the_gpu_when_the_host_runs_ahead():
    """The host launches five graph replays within 10 us (nothing throttles it), while the GPU
    is still finishing 300 us of work launched before profiling began; each replay then runs
    for 1 ms with a 20 us gap. Each step is 1.02 ms of GPU time, not the host's 2 us; the first
    also holds the leftover work, which is why the mean leaves it out."""
    events = [cpu(f"ProfilerStep#{n}", "user_annotation", 2 * n, 2) for n in range(5)]
    events.append(gpu_event("triton_poi_leftover", 0, 300, corr=999))  # its launch predates us
    for n in range(5):
        start = 300 + 20 + n * 1020
        events += gpu("cudnn_conv_fwd", "kernel", start, 600, launched=2 * n + 1)
        events += gpu("ncclDevKernel_AllReduce", "kernel", start + 500, 500, 2 * n + 1, stream=20)
    first, *steps = step_times({"traceEvents": events})
    assert first.total == pytest.approx(1.32)  # the leftover work, then its own replay
    assert [s.total for s in steps] == pytest.approx([1.02] * 4)
    for s in steps:
        assert s.compute == pytest.approx(0.6) and s.comm_exposed == pytest.approx(0.4)
        assert s.idle == pytest.approx(0.02) and s.comm == pytest.approx(0.5)


def test_parts_sum_to_the_step_time():
    for s in step_times(hand_made_trace()):
        assert sum(getattr(s, p) for p in PARTS) == pytest.approx(s.total, abs=1e-9)
        assert abs(s.residual()) < 1e-9


def test_profile_summary_command_recomputes_from_saved_traces(tmp_path, capsys):
    from fasttrain.__main__ import main

    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(hand_made_trace()))
    out = tmp_path / "b.json"
    assert main(["profile-summary", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean of 2 steps after the first" in text and "NCCL, not overlapped" in text
    assert f"  rank 0: {tmp_path / 'rank0.1.pt.trace.json'}" in text.splitlines()
    saved = json.loads(out.read_text())
    assert saved[0]["mean_ms"]["compute"] == pytest.approx(0.9 / 2)  # steps 2 and 3
    assert len(saved[0]["steps"]) == 3
    assert main(["profile-summary", str(tmp_path / "nothing")]) == 2


@pytest.mark.skipif(importlib.util.find_spec("hta") is None, reason="HolisticTraceAnalysis")
def test_holistic_trace_analysis_agrees_on_the_same_trace(tmp_path):
    """HTA's temporal breakdown over the whole trace (first kernel to last) against ours."""
    from hta.trace_analysis import TraceAnalysis

    trace = hand_made_trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if "late" not in e["name"]]
    (tmp_path / "rank0.1.pt.trace.json").write_text(json.dumps(trace))
    row = TraceAnalysis(trace_dir=str(tmp_path)).get_temporal_breakdown(visualize=False).iloc[0]
    s1, s2, _ = step_times(trace)
    # HTA spans the GPU events of the iterations it keeps, first start (50) to last end (1960)
    span = 1960 - 50
    ours_compute = (s1.compute + s2.compute) * 1e3
    ours_busy = (s1.total - s1.idle + s2.total - s2.idle) * 1e3
    print(row.to_dict())
    assert row["compute_time(us)"] == pytest.approx(ours_compute, abs=1)
    assert row["idle_time(us)"] == pytest.approx(span - ours_busy, abs=1)
    assert row["non_compute_time(us)"] == pytest.approx(ours_busy - ours_compute, abs=1)


@pytest.mark.slow
def test_profiled_cpu_run_writes_quiet_traces_and_a_breakdown(profiled_cpu_run):
    """A CPU run records quietly (no kineto start/stop lines, no failed GPU count, no metadata
    warnings), writes one trace per cycle with distributedInfo, and its breakdown."""
    out, done = profiled_cpu_run
    assert done.returncode == 0, done.stderr
    for noise in ("USDT", "gpuGetDeviceCount", "Profiler is not initialized", "ERROR:"):
        assert noise not in done.stderr, done.stderr
    traces = sorted((out / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    assert trace["distributedInfo"]["rank"] == 0  # written for single-process runs too
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#5", "fasttrain.data", "fasttrain.step"} <= names
    s = summarize(traces[0])
    assert len(s["steps"]) == 3 and s["device"] == "cpu" and s["residual_ms"] < 1e-6
    for step in s["steps"]:  # the copy to the device is inside the data range, and apart from it
        assert step["host_copy_in"] > 0 and step["host_loader_wait"] >= 0
        assert step["idle"] == pytest.approx(step["host_loader_wait"] + step["host_sync"])
    saved = json.loads((out / "profile" / "breakdown-rank0.json").read_text())
    assert saved["mean_ms"]["total"] == pytest.approx(s["mean_ms"]["total"])
    assert saved["idle_gaps"] is None  # no GPU work to have gaps in
    assert "step time breakdown, rank 0" in (out / "log-rank0.txt").read_text()
    assert "GPU idle inside the profiled steps" not in (out / "log-rank0.txt").read_text()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "profile" for r in records)


@pytest.mark.slow
def test_tensorboards_profiler_plugin_loads_the_run(profiled_cpu_run, tmp_path):
    """Load the run the way TensorBoard's PyTorch Profiler plugin does (its RunLoader, with its
    cache): it lists this rank and the views a CPU trace has."""
    pytest.importorskip(
        "torch_tb_profiler",
        reason="the profile-plugin extra is not installed: pip install -e .[profile-plugin]",
    )
    from torch_tb_profiler import io
    from torch_tb_profiler.profiler.loader import RunLoader

    out, done = profiled_cpu_run
    assert done.returncode == 0, done.stderr
    loaded = RunLoader("profile", str(out / "profile"), io.Cache(str(tmp_path / "tbcache"))).load()
    assert loaded is not None and loaded.workers == ["rank0"]
    assert {"Overview", "Operator", "Trace"} <= {v.display_name for v in loaded.views}


def test_a_run_shorter_than_the_profile_schedule_says_so_and_which_flags_change_it(
    run, tiny_data, tmp_path
):
    """--profile on a 3-step run with the default 20-step wait records nothing: a warning at
    the start and at the end names the flags, and profile-summary says why there is no trace."""
    out = tmp_path / "short"
    code, err = run(
        "--data", tiny_data, *FAST, "--max-steps", "3", "--eval-every", "0",
        "--output-dir", out, "--profile",
    )  # fmt: skip
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    start = "this run trains 3 steps, but the profiler records only after"
    assert log.count(start) == 2 and "--profile: no trace written" in log
    assert "= 27 steps, so it writes no trace; lower --profile-wait, or raise --max-steps" in log
    assert not list(out.glob("profile/*.pt.trace.json"))
    code, err = run("profile-summary", out / "profile")
    assert code == 2
    assert "the run ended before the profiler's schedule recorded anything" in err
    code, err = run("profile-summary", out)
    assert code == 2 and "ended before" in err
