"""Where the time to the first step goes, and what the run is doing while it waits.

``Startup`` marks the phases from the start of ``main`` (the interpreter's own start, about 0.2 s,
is before it) to the end of the first step: the imports, settings (and cuDNN's start-up probe)
and CUDA's start, the data (scan, loader or DALI pipeline), the model, and the first step
itself. The first step is split further with what
torch records of its compiles (``torch._dynamo.utils.get_compilation_metrics``: dynamo's trace,
AOT autograd, inductor, Triton's compile, kernel tuning), fasttrain's own cuDNN plan selection
and the CUDA graph's warm-up and capture; what none of them covers is "other". The parts sum to
the time to the first step. torch's own timers that ran in the start (``dynamo_timed``) go into
the report beside them, nested and overlapping, to say what "other" was spent in.

``Heartbeat`` logs every ``every`` seconds while the set-up (where dynamo's kept trace loads the
compiled step) and the first step run: the phase it is in, read from the threads' stacks (a
compile is one long call with no progress of its own), so a start-up that takes minutes never
goes silent.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import asdict, fields
from typing import Any

log = logging.getLogger("fasttrain")


# torch's compile metrics, in microseconds, one record per compiled graph. A forward record's
# fields nest: dynamo's time holds AOT autograd's, which holds inductor's, which holds the kernels'
# compile (Triton's; inductor's C++ on the CPU) and compile-time tuning. The backward graph
# compiles at the first backward, outside dynamo's frame: its record has its whole time
# (``backward_cumulative``) holding its inductor time, and no dynamo or AOT autograd field.
COMPILE_FIELDS = (
    "dynamo_cumulative_compile_time_us",
    "aot_autograd_cumulative_compile_time_us",
    "inductor_cumulative_compile_time_us",
    "triton_compile_time_us",
    "compile_time_autotune_time_us",
    "runtime_triton_autotune_time_us",
    "backward_cumulative_compile_time_us",
)


def _dynamo_utils() -> Any:
    """``torch._dynamo.utils``, where torch's compile metrics are; None before dynamo is
    imported (nothing compiled yet, and importing it costs a second) or on a torch without it."""
    if "torch._dynamo" not in sys.modules:
        return None
    try:
        import torch._dynamo.utils as utils
    except ImportError:
        return None
    return utils


def compile_totals() -> dict[str, float]:
    """torch's compile metrics so far, in seconds, summed over the graphs compiled (zeros where
    this torch does not record a field); with the FX graph cache's hits and misses."""
    utils = _dynamo_utils()
    if utils is None:
        return {}
    counters, get_compilation_metrics = utils.counters, utils.get_compilation_metrics
    out = dict.fromkeys(COMPILE_FIELDS, 0.0)
    out.update(fx_cache_hits=0.0, fx_cache_misses=0.0)
    aot = counters["aot_autograd"]  # AOT autograd's own cache: a bypass re-traces every start
    for name in ("hit", "miss", "bypass"):
        out[f"aot_cache_{name}"] = float(aot.get(f"autograd_cache_{name}", 0))
    traces = counters["dynamo_cache"]  # dynamo's own (caching precompile): a hit traces nothing
    for name in ("hit", "miss", "error"):
        out[f"trace_cache_{name}"] = float(traces.get(f"dynamo_cache_{name}", 0))
    # Triton's kernels: loaded with their compiled variants (a cache entry's), how many of
    # inductor's lookups a loaded one answered, compiled (each call of ``async_compile.triton``
    # counts a miss, and a hit where a loaded one answered it), and coordinate descent's
    # benchmarks: a warm start that compiles or tunes is told apart
    ind = counters["inductor"]
    out["kernels_loaded"] = float(ind.get("triton_bundler_load_static_autotuner", 0))
    out["kernels_used"] = float(ind.get("async_compile_cache_hit", 0))
    out["kernels_compiled"] = float(ind.get("async_compile_cache_miss", 0)) - out["kernels_used"]
    out["tuning_benchmarks"] = float(ind.get("coordesc_tuning_bench", 0))
    for m in get_compilation_metrics():
        known = {f.name for f in fields(m)}
        values = asdict(m)
        for name in COMPILE_FIELDS:
            if name in known and values[name]:
                out[name] += values[name] / 1e6
        out["fx_cache_hits"] += values.get("inductor_fx_local_cache_hit_count") or 0
        out["fx_cache_misses"] += values.get("inductor_fx_local_cache_miss_count") or 0
    return out


# inductor's compile of a loaded kernel's tuned configuration, which its cache entry lacks: a hit
# in Triton's cache where the run's kept kernels were put back, a compile of each where not
TUNED_BINARIES = "CachingAutotuner.slow_precompile_config"
LOADING = "tuned kernels' binaries, as the step loaded"


def torch_timers() -> dict[str, float]:
    """torch's own ``dynamo_timed`` timers so far, seconds summed per name; empty before
    dynamo is imported."""
    utils = _dynamo_utils()
    if utils is None:
        return {}
    return {k: float(sum(v)) for k, v in utils.compilation_time_metrics.items()}


def tuned_binaries_s() -> float:
    """Seconds this process has spent getting loaded kernels' tuned binaries (``TUNED_BINARIES``,
    as torch's ``dynamo_timed`` records them); 0 before anything compiled or loaded."""
    return torch_timers().get(TUNED_BINARIES, 0.0)


TIMERS_SHOWN = 12  # the longest of torch's own timers a report keeps
TIMER_MIN_S = 0.05


def timers_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The longest timers that ran between two ``torch_timers`` readings, longest first. They
    nest and overlap, so they do not sum to anything: they say what a part, "first step,
    other" above all, was spent in, where torch times it (loading the compiled modules,
    waiting for kernels, building guards)."""
    grew = {k: v - before.get(k, 0.0) for k, v in after.items()}
    longest = sorted((kv for kv in grew.items() if kv[1] >= TIMER_MIN_S), key=lambda kv: -kv[1])
    return {k: round(v, 3) for k, v in longest[:TIMERS_SHOWN]}


def compile_parts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The compile's parts between two ``compile_totals`` readings, each exclusive of the
    others (the nesting is described above ``COMPILE_FIELDS``); they sum to the forward's
    dynamo time and the backward's whole time, and the first run's tuning."""
    d = {k: max(0.0, after.get(k, 0.0) - before.get(k, 0.0)) for k in COMPILE_FIELDS}
    aot = d["aot_autograd_cumulative_compile_time_us"]  # the forward graphs'
    backward = d["backward_cumulative_compile_time_us"]
    inductor = d["inductor_cumulative_compile_time_us"]  # both directions'
    kernels, tuning = d["triton_compile_time_us"], d["compile_time_autotune_time_us"]
    return {
        "dynamo trace": max(0.0, d["dynamo_cumulative_compile_time_us"] - aot),
        "AOT autograd": max(0.0, aot + backward - inductor),
        "inductor codegen": max(0.0, inductor - kernels - tuning),
        "Triton compile": kernels,
        "kernel tuning": tuning + d["runtime_triton_autotune_time_us"],
    }


def fx_cache_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The FX graph cache's hits and misses between two ``compile_totals`` readings."""
    return {
        name: int(after.get(f"fx_cache_{name}", 0) - before.get(f"fx_cache_{name}", 0))
        for name in ("hits", "misses")
    }


class Startup:
    """The phases to the first step (module notes); ``mark`` ends one."""

    def __init__(self, t_start: float, jit_cache_empty: bool | None = None):
        self.t_start = t_start
        # CUDA's JIT cache as the process found it, before any CUDA work filled it (a new
        # machine: ``step/conv_warmup.py``); None where nobody asked
        self.jit_cache_empty = jit_cache_empty
        self.parts: dict[str, float] = {}
        self.last = t_start
        self.compile_before = compile_totals()
        self.timers_before = torch_timers()
        self.binaries = tuned_binaries_s()

    def mark(self, name: str) -> None:
        """The phase since the last mark is ``name``, less the loaded kernels' tuned binaries
        got in it (dynamo's kept trace loads the step as the model is built), a part of their
        own (``LOADING``): seconds where the machine has them, a compile of each where not."""
        now, binaries = time.perf_counter(), tuned_binaries_s()
        got = min(max(0.0, binaries - self.binaries), now - self.last)
        self.parts[name] = self.parts.get(name, 0.0) + now - self.last - got
        if got > 0:
            self.parts[LOADING] = self.parts.get(LOADING, 0.0) + got
        self.last, self.binaries = now, binaries

    def leave_out(self, seconds: float) -> None:
        """The ``seconds`` just spent belong to no part and not to the total: a one-off that a
        later start does not repeat (the built-in sample set's build)."""
        self.t_start += seconds
        self.last += seconds

    def fx_graph_cache(self) -> dict[str, int]:
        """Inductor's FX graph cache's hits and misses since this start: a start that found
        everything compiled has no miss."""
        return fx_cache_counts(self.compile_before, compile_totals())

    def first_step(self, t_step: float, inner: dict[str, float]) -> dict[str, Any]:
        """The first step began at ``t_step`` and ends now; ``inner``: what fasttrain timed
        inside it (cuDNN's plans). Returns the report: each part in seconds, summing to
        ``total_s``, and the compile caches' hits."""
        now = time.perf_counter()
        self.parts["before the first step"] = t_step - self.last
        seconds = now - t_step  # split below
        totals = compile_totals()
        step = {**compile_parts(self.compile_before, totals), **inner}
        step = {k: v for k, v in step.items() if v > 0}
        known = sum(step.values())
        step["first step, other"] = max(0.0, seconds - known)
        parts = {k: v for k, v in self.parts.items() if v > 0.0005} | step
        total = now - self.t_start

        def new(name: str) -> int:
            return int(totals.get(name, 0) - self.compile_before.get(name, 0))

        return {
            "total_s": total,
            "parts_s": {k: round(v, 3) for k, v in parts.items()},
            "fx_graph_cache": fx_cache_counts(self.compile_before, totals),
            "aot_autograd_cache": {k: new(f"aot_cache_{k}") for k in ("hit", "miss", "bypass")},
            "trace_cache": {k: new(f"trace_cache_{k}") for k in ("hit", "miss", "error")},
            "torch_timers_s": timers_since(self.timers_before, torch_timers()),
            "triton_kernels": {
                k: new(name)
                for k, name in (
                    ("loaded", "kernels_loaded"),
                    ("used", "kernels_used"),
                    ("compiled", "kernels_compiled"),
                    ("tuning_benchmarks", "tuning_benchmarks"),
                )
            },
        }


def describe(report: dict[str, Any]) -> str:
    """One line: the parts of the time to the first step, largest first."""
    parts = sorted(report["parts_s"].items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{k} {v:.1f} s" for k, v in parts if v >= 0.05)
    cache, aot = report["fx_graph_cache"], report.get("aot_autograd_cache", {})
    graphs = f"; inductor's FX graph cache: {cache['hits']} hits, {cache['misses']} misses"
    if sum(aot.values()):
        graphs += (
            f"; AOT autograd's cache: {aot['hit']} hits, {aot['miss']} misses, "
            f"{aot['bypass']} bypassed"
        )
    hits = report.get("trace_cache", {}).get("hit", 0)
    loaded = f"; dynamo's trace loaded from the cache ({hits})" if hits else ""
    graphs = graphs if sum(cache.values()) else ""
    kernels = report.get("triton_kernels", {})
    kernels = (
        f"; Triton kernels: {kernels['loaded']} loaded compiled ({kernels.get('used', 0)} "
        f"used), {kernels['compiled']} compiled, {kernels['tuning_benchmarks']} tuning benchmarks"
        if sum(kernels.values())
        else ""
    )
    ahead = report.get("tuning_candidates_ahead", 0)
    ahead = f"; {ahead} tuning candidates sent to inductor's workers to compile" if ahead else ""
    return f"start-up {report['total_s']:.1f} s: {shown}{graphs}{loaded}{kernels}{ahead}"


# (phase, path fragments of a frame's file, function-name fragments or None for any), most
# specific first: a stack holding several is in the first that matches. Inductor's runtime
# (``torch/_inductor/runtime/``) runs the compiled kernels: it is a phase only when it tunes.
PHASES = (
    ("tuning Triton kernels", ("coordinate_descent_tuner",), None),
    (
        "tuning Triton kernels",
        ("triton_heuristics",),
        ("autotune", "benchmark", "coordinate_descent"),
    ),
    ("autotuning kernel choices", ("select_algorithm", "autotune_process"), None),
    ("compiling Triton kernels", ("async_compile", "/triton/compiler"), None),
    ("building and timing cuDNN plans", ("fasttrain/model/cudnn/",), None),
    # dynamo's kept trace, installed as torch.compile wraps the step: inductor's code loaded
    ("loading the compiled step", ("torch/_dynamo/package.py",), ("install", "load")),
    # dynamo's end of compile joins the thread that runs cuDNN's convolutions ahead
    # (``step/conv_warmup.py``): the main thread then waits in dynamo, for the convolutions
    ("waiting for cuDNN's convolutions run ahead", ("fasttrain/step/conv_warmup.py",), ("wait",)),
    ("capturing the CUDA graph", ("torch/cuda/graphs.py",), None),
    ("inductor: lowering and code generation", ("torch/_inductor/",), None),
    ("AOT autograd", ("torch/_functorch/",), None),
    ("dynamo: tracing the step", ("torch/_dynamo/",), None),
)
RUNTIME = "torch/_inductor/runtime/"


def phase_of(frame: Any) -> str:
    """What a thread is doing, from its stack (innermost ``frame``): its most specific phase."""
    found: set[int] = set()
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        name = frame.f_code.co_name
        for i, (phase, paths, names) in enumerate(PHASES):
            if not any(p in path for p in paths):
                continue
            if phase.startswith("inductor") and RUNTIME in path:
                continue  # the runtime's own frames are no compile
            if names is None or any(n in name for n in names):
                found.add(i)
        frame = frame.f_back
    return PHASES[min(found)][0] if found else "running the step"


class Heartbeat:
    """Logs what the process is doing every ``every`` seconds until it exits (module notes):
    ``what`` it waits for, and ``otherwise`` where no thread is in a known phase."""

    def __init__(
        self,
        what: str,
        t_start: float,
        every: float = 10.0,
        otherwise: str = "running the step",
        within: str = "the step",
    ):
        self.what, self.t_start, self.every = what, t_start, every
        self.otherwise, self.within = otherwise, within
        self.done = threading.Event()
        self.since = time.perf_counter()
        self.phase, self.phase_since = "", self.since
        self.thread = threading.Thread(target=self._run, name="fasttrain-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def beat(self) -> str:
        """The line for now: the most specific phase of any thread but this one (the backward
        runs, and compiles, on autograd's own thread while the main thread waits in it)."""
        now = time.perf_counter()
        mine = threading.get_ident()
        phases = [phase_of(f) for t, f in sys._current_frames().items() if t != mine]
        order = [p for p, _, _ in PHASES]
        known = [p for p in phases if p in order]
        phase = min(known, key=order.index) if known else self.otherwise
        if phase != self.phase:
            self.phase, self.phase_since = phase, now
        return (
            f"{self.what}: {phase} for {now - self.phase_since:.0f} s "
            f"({now - self.since:.0f} s in {self.within}, {now - self.t_start:.0f} s since start)"
        )

    def _run(self) -> None:
        while not self.done.wait(self.every):
            log.info("%s", self.beat())
