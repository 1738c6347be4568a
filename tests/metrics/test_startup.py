"""Where the time to the first step goes (``metrics/startup.py``): the parts of torch's compile
metrics, the report's sum, and the heartbeat that names the phase while the first step runs."""

from __future__ import annotations

import json
import logging
import sys
import time

import pytest

from fasttrain.metrics import startup
from fasttrain.metrics.startup import Heartbeat, Startup, compile_parts, describe, phase_of
from tests.conftest import FAST


def test_a_one_off_left_out_is_in_no_part_and_not_in_the_total(monkeypatch):
    """The built-in sample set's build: the imports before it still count."""
    monkeypatch.setattr(startup, "compile_totals", lambda: {})
    clock = Startup(time.perf_counter())
    time.sleep(0.05)
    clock.mark("imports, flags and the process group")
    t_build = time.perf_counter()
    time.sleep(0.2)  # the build
    clock.leave_out(time.perf_counter() - t_build)
    time.sleep(0.03)
    clock.mark("data: scan and loader")
    report = clock.first_step(time.perf_counter(), {})
    parts = report["parts_s"]
    assert parts["imports, flags and the process group"] == pytest.approx(0.05, abs=0.02)
    assert parts["data: scan and loader"] == pytest.approx(0.03, abs=0.02)
    assert report["total_s"] == pytest.approx(0.08, abs=0.03)
    assert sum(parts.values()) == pytest.approx(report["total_s"], abs=0.005)


def test_tuned_binaries_got_while_the_step_loads_are_a_part_of_their_own(monkeypatch):
    """Dynamo's kept trace loads the step as the model is built, and inductor gets each loaded
    kernel's tuned binary then (torch's ``dynamo_timed`` records it): those seconds leave the
    model's part for one of their own, and the parts still sum to the total."""
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(startup, "compile_totals", lambda: {})
    metrics = {"something else": [9.0]}
    monkeypatch.setattr(dynamo_utils, "compilation_time_metrics", metrics)
    clock = Startup(time.perf_counter())
    time.sleep(0.05)
    clock.mark("data: scan and loader")
    time.sleep(0.3)
    metrics[startup.TUNED_BINARIES] = [0.1, 0.1]  # two kernels' binaries in the model's build
    clock.mark("model and optimizer")
    report = clock.first_step(time.perf_counter(), {})
    parts = report["parts_s"]
    assert parts[startup.LOADING] == pytest.approx(0.2, abs=1e-3)
    assert parts["model and optimizer"] == pytest.approx(0.1, abs=0.03)
    assert parts["data: scan and loader"] == pytest.approx(0.05, abs=0.02)
    assert sum(parts.values()) == pytest.approx(report["total_s"], abs=0.005)


def test_the_demo_counts_its_imports_and_leaves_its_sample_set_s_build_out(
    run, tiny_data, tmp_path, monkeypatch
):
    """Without --data the built-in sample set is built first, once: the start-up report leaves
    that out and still counts the imports and settings before it."""
    from fasttrain.data import sample

    builds = []

    def build_sample(root, spec=None, log=print, bar=False):
        if not builds:
            time.sleep(1.0)  # the one-off build
        builds.append(root)
        return tiny_data

    monkeypatch.setattr(sample, "build_sample", build_sample)
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    t0 = time.perf_counter()
    code, err = run(*FAST, "--max-steps", "1", "--eval-every", "0", "--output-dir", tmp_path / "r")
    wall = time.perf_counter() - t0
    assert code == 0, err
    report = json.loads((tmp_path / "r" / "summary.json").read_text())["startup"]
    parts = report["parts_s"]
    assert builds and "imports, flags and the process group" in parts
    # the settings part, where the build would have gone (under 0.5 ms it is not listed)
    assert parts.get("settings and cuDNN's probe", 0.0) < 1.0
    assert report["total_s"] < wall - 1.0


def test_compile_parts_are_each_field_less_the_one_inside_it():
    """The forward: dynamo 10 s holds AOT autograd 8 s, which holds inductor 6 s. The backward,
    compiled at the first backward: 4 s in all, inductor 3 s of it. Inductor's 9 s hold the
    kernels' compile (3 s) and compile-time tuning (1 s); the first run tuned 2 s more. The
    numbers are the shape torch 2.14 reports on the CPU for ResNet-18 (forward 31.4 s: AOT
    29.8, inductor 25.7; backward 12.0: inductor 11.9; kernels 15.5 in all)."""
    before = dict.fromkeys(startup.COMPILE_FIELDS, 0.0)
    after = {
        "dynamo_cumulative_compile_time_us": 10.0,
        "aot_autograd_cumulative_compile_time_us": 8.0,
        "backward_cumulative_compile_time_us": 4.0,
        "inductor_cumulative_compile_time_us": 9.0,
        "triton_compile_time_us": 3.0,
        "compile_time_autotune_time_us": 1.0,
        "runtime_triton_autotune_time_us": 2.0,
    }
    parts = compile_parts(before, after)
    assert parts == {
        "dynamo trace": 2.0,
        "AOT autograd": 3.0,
        "inductor codegen": 5.0,
        "Triton compile": 3.0,
        "kernel tuning": 3.0,
    }
    assert sum(parts.values()) == 10.0 + 4.0 + 2.0
    assert compile_parts(after, after) == dict.fromkeys(parts, 0.0)


def test_the_parts_sum_to_the_time_to_the_first_step(monkeypatch):
    monkeypatch.setattr(startup, "compile_totals", lambda: {})
    t0 = time.perf_counter()
    clock = Startup(t0)
    time.sleep(0.05)
    clock.mark("data: scan and loader")
    time.sleep(0.02)
    t_step = time.perf_counter()
    time.sleep(0.1)
    report = clock.first_step(t_step, {"cuDNN plans": 0.04})
    parts = report["parts_s"]
    assert list(parts)[:2] == ["data: scan and loader", "before the first step"]
    assert parts["data: scan and loader"] == pytest.approx(0.05, abs=0.02)
    assert parts["cuDNN plans"] == 0.04
    assert parts["first step, other"] == pytest.approx(0.06, abs=0.02)
    assert sum(parts.values()) == pytest.approx(report["total_s"], abs=0.005)
    line = describe(report)
    assert line.startswith(f"start-up {report['total_s']:.1f} s: first step, other")
    assert "FX graph cache" not in line  # nothing compiled
    assert "dynamo's trace" not in line


def test_a_start_from_dynamos_trace_says_so(monkeypatch):
    totals = {"trace_cache_hit": 0.0}  # torch's counters as read at start, then at the step
    monkeypatch.setattr(startup, "compile_totals", lambda: dict(totals))
    clock = Startup(time.perf_counter())
    totals["trace_cache_hit"] = 1.0
    report = clock.first_step(time.perf_counter(), {})
    assert report["trace_cache"] == {"hit": 1, "miss": 0, "error": 0}
    assert describe(report).endswith("; dynamo's trace loaded from the cache (1)")


def test_a_start_says_how_its_triton_kernels_came(monkeypatch):
    """Loaded with their compiled variants, compiled, tuned: a warm start that compiles or tunes
    its kernels again shows it in its line and summary."""
    totals = {"kernels_loaded": 2.0, "kernels_used": 2.0, "kernels_compiled": 1.0,
              "tuning_benchmarks": 0.0}  # fmt: skip
    monkeypatch.setattr(startup, "compile_totals", lambda: dict(totals))
    clock = Startup(time.perf_counter())
    assert "Triton kernels" not in describe(clock.first_step(time.perf_counter(), {}))
    totals.update(kernels_loaded=129.0, kernels_used=126.0, kernels_compiled=4.0,
                  tuning_benchmarks=30.0)  # fmt: skip
    report = clock.first_step(time.perf_counter(), {})
    assert report["triton_kernels"] == {
        "loaded": 127, "used": 124, "compiled": 3, "tuning_benchmarks": 30}  # fmt: skip
    assert (
        "; Triton kernels: 127 loaded compiled (124 used), 3 compiled, 30 tuning benchmarks"
        in describe(report)
    )


def test_torch_s_own_timers_since_the_start_are_kept_longest_first(monkeypatch):
    """What "first step, other" was spent in, where torch times it: the timers that grew since
    the start (not before it), longest first, the short ones left out."""
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setattr(startup, "compile_totals", lambda: {})
    metrics = {"before the start": [5.0]}
    monkeypatch.setattr(dynamo_utils, "compilation_time_metrics", metrics)
    clock = Startup(time.perf_counter())
    metrics["before the start"].append(0.01)  # grew by less than is kept
    metrics["PyCodeCache.load_by_key_path"] = [0.4, 0.3]
    metrics["async_compile.wait"] = [1.5]
    metrics["precompile_build_guards"] = [0.2]
    report = clock.first_step(time.perf_counter(), {})
    assert list(report["torch_timers_s"].items()) == [
        ("async_compile.wait", 1.5),
        ("PyCodeCache.load_by_key_path", 0.7),
        ("precompile_build_guards", 0.2),
    ]
    metrics.update({f"timer {i}": [1.0] for i in range(20)})
    assert len(clock.first_step(time.perf_counter(), {})["torch_timers_s"]) == startup.TIMERS_SHOWN


def test_torch_s_counters_are_read_as_the_kernels_came(monkeypatch):
    """``compile_totals`` reads inductor's counters: each ``async_compile.triton`` call counts
    a miss, and a hit where a loaded kernel answered it."""
    pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "inductor", counters["inductor"].copy())
    ind = counters["inductor"]
    before = startup.compile_totals()
    ind["triton_bundler_load_static_autotuner"] += 5
    ind["async_compile_cache_miss"] += 7
    ind["async_compile_cache_hit"] += 5
    ind["coordesc_tuning_bench"] += 11
    after = startup.compile_totals()
    assert {k: after[k] - before[k] for k in ("kernels_loaded", "kernels_used",
                                             "kernels_compiled", "tuning_benchmarks")} == {
        "kernels_loaded": 5, "kernels_used": 5, "kernels_compiled": 2,
        "tuning_benchmarks": 11}  # fmt: skip


def _in_file(path: str, source: str) -> dict:
    """Functions defined as if in ``path`` (a frame's file is what ``phase_of`` reads)."""
    scope: dict = {}
    exec(compile(source, path, "exec"), scope)
    return scope


def test_the_phase_is_the_most_specific_on_the_stack():
    dynamo = _in_file("/site/torch/_dynamo/convert_frame.py", "def compile(f): return f()")
    inductor = _in_file("/site/torch/_inductor/graph.py", "def lower(f): return f()")
    tuner = _in_file(
        "/site/torch/_inductor/runtime/triton_heuristics.py",
        "def coordinate_descent_tuning(f): return f()\ndef run(f): return f()",
    )

    def here() -> str:  # the phase, read inside the calls (a returned frame has no caller)
        return phase_of(sys._getframe())

    assert here() == "running the step"
    assert dynamo["compile"](here) == "dynamo: tracing the step"
    assert dynamo["compile"](lambda: inductor["lower"](here)) == (
        "inductor: lowering and code generation"
    )
    tuning = dynamo["compile"](lambda: tuner["coordinate_descent_tuning"](here))
    assert tuning == "tuning Triton kernels"
    # the same file, a function that is not tuning: inductor's runtime is no phase of its own
    assert tuner["run"](here) == "running the step"
    descent = _in_file(
        "/site/torch/_inductor/runtime/coordinate_descent_tuner.py", "def f(g): return g()"
    )
    assert descent["f"](here) == "tuning Triton kernels"


def test_waiting_for_the_convolutions_ahead_is_named_not_dynamo():
    """Dynamo's end of compile joins the thread that runs cuDNN's convolutions: that wait is
    said as such; the thread's own run, beside a compile, is not a phase."""
    dynamo = _in_file("/site/torch/_dynamo/callback.py", "def end(f): return f()")
    warmup = _in_file(
        "/site/fasttrain/step/conv_warmup.py", "def wait(f): return f()\ndef _run(f): return f()"
    )

    def here() -> str:
        return phase_of(sys._getframe())

    waiting = dynamo["end"](lambda: warmup["wait"](here))
    assert waiting == "waiting for cuDNN's convolutions run ahead"
    assert warmup["_run"](here) == "running the step"


def test_the_heartbeat_says_what_the_first_step_waits_for(caplog):
    triton = _in_file(
        "/site/torch/_inductor/async_compile.py",
        "import time\ndef wait(s): time.sleep(s)",
    )
    with (
        caplog.at_level(logging.INFO, logger="fasttrain"),
        Heartbeat("first step", time.perf_counter() - 100, every=0.05),
    ):
        triton["wait"](0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) >= 3, lines
    assert lines[-1].startswith("first step: compiling Triton kernels for ")
    assert "s in the step, 10" in lines[-1] and lines[-1].endswith(" s since start)")


def test_loading_dynamo_s_kept_trace_is_a_phase_and_a_compile_inside_it_is_named():
    """As torch.compile wraps the step, dynamo installs its kept trace, loading inductor's code
    (which reads like inductor's code generation) and compiling any kernel whose binary this
    machine lacks: the first is "loading the compiled step", the second the kernels' compile."""
    package = _in_file("/site/torch/_dynamo/package.py", "def install(f): return f()")
    codecache = _in_file(
        "/site/torch/_inductor/codecache.py", "def load_by_key_path(f): return f()"
    )
    triton = _in_file("/site/triton/compiler/compiler.py", "def compile(f): return f()")

    def here() -> str:
        return phase_of(sys._getframe())

    assert package["install"](lambda: codecache["load_by_key_path"](here)) == (
        "loading the compiled step"
    )
    inside = package["install"](
        lambda: codecache["load_by_key_path"](lambda: triton["compile"](here))
    )
    assert inside == "compiling Triton kernels"


def test_the_set_up_has_a_heartbeat_of_its_own(caplog, monkeypatch):
    """The set-up (the data, the model, dynamo's kept trace) beats as the first step does, on
    the main process only, in its own words."""
    import types

    from fasttrain.run import setup

    monkeypatch.setattr(setup, "Heartbeat", lambda *a, **k: Heartbeat(*a, **{**k, "every": 0.05}))
    startup_ = Startup(time.perf_counter() - 30)
    package = _in_file(
        "/site/torch/_dynamo/package.py", "import time\ndef install(s): time.sleep(s)"
    )
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        with setup.setup_heartbeat(types.SimpleNamespace(is_main=False), startup_):
            time.sleep(0.2)
        assert not caplog.records  # another rank: silent
        with setup.setup_heartbeat(types.SimpleNamespace(is_main=True), startup_):
            package["install"](0.3)
            time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert any(x.startswith("setting up: loading the compiled step for ") for x in lines), lines
    assert lines[-1].startswith("setting up: building the data and the model for "), lines
    assert " s in the set-up, 3" in lines[-1] and lines[-1].endswith(" s since start)")


def test_the_heartbeat_reads_every_thread(caplog):
    """The backward compiles on autograd's own thread while the main thread waits in it."""
    import threading

    aot = _in_file("/site/torch/_functorch/_aot_autograd/runtime_wrappers.py", "def bw(f): f()")
    worker = threading.Thread(target=aot["bw"], args=(lambda: time.sleep(0.3),))
    with (
        caplog.at_level(logging.INFO, logger="fasttrain"),
        Heartbeat("first step", time.perf_counter(), every=0.05),
    ):
        worker.start()
        worker.join()  # the main thread waits, as in loss.backward()
    assert any("first step: AOT autograd for" in r.getMessage() for r in caplog.records)
