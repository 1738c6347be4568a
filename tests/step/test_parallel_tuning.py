"""Coordinate descent's candidates compiled ahead (step/parallel_tuning.py): which configurations
go, which kernels send them, and that the tuner's own compile of one sent ahead is a load from
Triton's cache, not a compile. Triton compiles for an H100/H200 target here without a GPU; the
worker pool and the tuning itself run in the GPU test and in BENCHMARKS' start-up figures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain.step import parallel_tuning as pt
from tests.step.kernel_source import NAME, SOURCE, launched


def fields(config) -> dict[str, int]:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def test_candidates_move_one_field_at_a_time_and_hold_the_first_round(kernel):
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable

    start = kernel.configs[0]
    got = pt.candidates(kernel.coordesc_tuner, [start])
    keys = [triton_config_to_hashable(c) for c in got]
    assert len(keys) == len(set(keys)) and triton_config_to_hashable(start) not in keys
    for config in got:
        moved = {k: v for k, v in fields(config).items() if fields(start)[k] != v}
        assert len(moved) == 1, moved
        (name, value), was = next(iter(moved.items())), fields(start)[next(iter(moved))]
        assert max(value, was) / min(value, was) in (2, 4)
    # the tuner's own first round (one step either side of each field) is all there
    tuner = kernel.coordesc_tuner
    for name in ("XBLOCK", "num_warps"):
        for value in tuner.get_neighbour_values(name, fields(start)[name]):
            assert any(fields(c)[name] == value for c in got), (name, value)


CHECK = """
import json, os, sys
from pathlib import Path
from torch._inductor.codecache import PyCodeCache
from torch._inductor.runtime import triton_helpers
from fasttrain.step import parallel_tuning as pt
from tests.step.kernel_source import NAME, SOURCE, launched

source, name = sys.argv[1], sys.argv[2]
triton_helpers.set_driver_to_gpu = lambda: None  # no GPU: the target is given explicitly
kernel = getattr(PyCodeCache.load(source), name)
first, other = pt.candidates(kernel.coordesc_tuner, [kernel.configs[0]])[:2]
cache = Path(os.environ["TRITON_CACHE_DIR"])
entries = lambda: sum(1 for _ in cache.iterdir()) if cache.is_dir() else 0
out = {"worker": pt.compile_candidate(name, source, first, {"TRITON_CACHE_DIR": str(cache)})}
out["after_worker"] = entries()
kernel._precompile_config(first)  # what the tuner does for the candidate it benchmarks
out["after_tuner"] = entries()
kernel._precompile_config(other)  # one not sent ahead
out["after_other"] = entries()
print(json.dumps(out))
"""


def test_the_tuners_compile_of_a_candidate_sent_ahead_loads_it(tmp_path):
    """In a fresh process: these tests' own run Triton in its interpreter, whose mode a
    compile for the GPU cannot share."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", CHECK, SOURCE, NAME], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["worker"] and got["after_worker"] >= 1
    assert got["after_tuner"] == got["after_worker"]  # found in Triton's cache: not compiled
    assert got["after_other"] == got["after_worker"] + 1  # compiled, as before


SHARED_PTXAS = """
import json, os, sys
from pathlib import Path
from torch._inductor.codecache import PyCodeCache
from torch._inductor.runtime import compile_tasks, triton_helpers
from fasttrain.step import parallel_tuning as pt, torch_fixes

role, source, name, torch_dir = sys.argv[1:5]
# inductor as installed in torch_dir, whose bin/ptxas its compile workers then use
compile_tasks.__file__ = str(Path(torch_dir) / "_inductor" / "runtime" / "compile_tasks.py")
getattr(compile_tasks._set_triton_ptxas_path, "cache_clear", lambda: None)()
triton_helpers.set_driver_to_gpu = lambda: None  # no GPU: the target is given explicitly
kernel = getattr(PyCodeCache.load(source), name)
first = pt.candidates(kernel.coordesc_tuner, [kernel.configs[0]])[0]
cache = Path(os.environ["TRITON_CACHE_DIR"])
entries = lambda: sum(1 for _ in cache.iterdir()) if cache.is_dir() else 0
if role == "worker":
    print(json.dumps({"ok": pt.compile_candidate(name, source, first, {}), "entries": entries()}))
else:
    shared = role == "shared" and torch_fixes.share_ptxas_with_compile_workers()
    before = entries()
    kernel._precompile_config(first)  # the tuner's compile, in the training process
    print(json.dumps({"shared": shared, "new": entries() - before}))
"""


def test_a_torch_that_ships_ptxas_shares_it_or_every_candidate_compiles_twice(tmp_path):
    """A worker and the training process in processes of their own, with inductor installed
    where a ``ptxas`` of another version is shipped: the training process finds the worker's
    kernel in Triton's cache only once it uses that ``ptxas`` too (torch_fixes)."""
    import triton

    real = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not real.is_file():
        pytest.skip("this Triton ships no ptxas")
    shipped = tmp_path / "torch" / "bin" / "ptxas"  # the same compiler, another version string
    shipped.parent.mkdir(parents=True)
    shipped.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then\n'
        "  echo 'ptxas: NVIDIA (R) Ptx optimizing assembler, as shipped with torch'\n"
        "  echo 'Cuda compilation tools, release 12.8, V12.8.93'\n  exit 0\nfi\n"
        f'exec {real} "$@"\n'
    )
    shipped.chmod(0o755)
    unset = ("TRITON_INTERPRET", "TRITON_PTXAS_PATH")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path))

    def run(role: str, cache: str) -> dict:
        args = [sys.executable, "-c", SHARED_PTXAS, role, SOURCE, NAME, str(shipped.parent.parent)]
        env["TRITON_CACHE_DIR"] = str(tmp_path / cache)
        done = subprocess.run(args, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run("worker", "triton")["ok"]
    shutil.copytree(tmp_path / "triton", tmp_path / "copy")  # each a cache as the worker left it
    assert run("unshared", "triton") == {"shared": False, "new": 1}  # Triton's own: compiled
    assert run("shared", "copy") == {"shared": True, "new": 0}  # the worker's ptxas: loaded


class Recorder:
    def __init__(self):
        self.tasks = []

    def submit(self, fn, *args):
        self.tasks.append((fn, args))


@pytest.fixture
def pool(monkeypatch):
    from torch._inductor.async_compile import AsyncCompile

    recorder = Recorder()
    monkeypatch.setattr(AsyncCompile, "process_pool", staticmethod(lambda: recorder))
    return recorder


def test_a_kernel_to_be_tuned_sends_its_candidates(kernel, pool):
    start = kernel.configs[0]
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable as key

    n = pt.send(launched(kernel, start))
    want = [key(c) for c in pt.candidates(kernel.coordesc_tuner, [start])]
    assert n == len(want) == len(pool.tasks) > 0
    assert [key(args[2]) for _, args in pool.tasks] == want
    fn, (name, source, _, env) = pool.tasks[0]
    assert fn is pt.compile_candidate and name == NAME and source == SOURCE
    assert env["TRITON_CACHE_DIR"] and pt.candidates_sent() >= n


def test_kernels_that_will_not_be_tuned_send_nothing(kernel, pool):
    import copy

    found = copy.deepcopy(kernel.configs[0])
    found.found_by_coordesc = True  # the autotune cache's choice: a warm start tunes nothing
    assert pt.send(launched(kernel, found)) == 0
    kernel.inductor_meta = {**kernel.inductor_meta, "coordinate_descent_tuning": False}
    assert pt.send(launched(kernel, kernel.configs[0])) == 0
    assert pool.tasks == []


def test_candidates_held_back_go_to_the_workers_in_order_when_released(kernel, pool, monkeypatch):
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable as key

    monkeypatch.setattr(pt, "_held", None)
    monkeypatch.setattr(pt, "_in_flight", {})
    start = kernel.configs[0]
    pt.hold()
    n = pt.send(launched(kernel, start))
    assert n > 0 and pool.tasks == [] and pt.candidates_compiling() == n
    # a candidate held is not under way: the tuner, coming first, compiles it itself
    assert not pt.wait_for(kernel.coordesc_tuner, pt.candidates(kernel.coordesc_tuner, [start])[0])
    assert pt.release() == n and pt.release() == 0
    want = [key(c) for c in pt.candidates(kernel.coordesc_tuner, [start])]
    assert [key(args[2]) for _, args in pool.tasks] == want
    assert pt.send(kernel) == 0  # sent once, held or not


def test_candidates_held_back_are_dropped_when_holding_stops(kernel, pool, monkeypatch):
    monkeypatch.setattr(pt, "_held", None)
    pt.hold()
    assert pt.send(launched(kernel, kernel.configs[0])) > 0
    pt.hold(False)
    assert pt.candidates_compiling() == 0 and pt.release() == 0 and pool.tasks == []


class Futures:
    """A pool whose tasks stay under way until the test finishes them."""

    def __init__(self):
        self.tasks = []

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        self.tasks.append((args[2], future))
        return future

    def finish(self):
        for _, future in self.tasks:
            if not future.done():
                future.set_result(True)


def descend(kernel, monkeypatch, follow: bool):
    """Coordinate descent on ``kernel`` with made-up timings that reward a larger XBLOCK and
    fewer warps (so it moves along both fields, over rounds), as the tuner's first call would
    run it. Returns the configurations it benchmarked, in order, and the one it chose."""
    from torch._inductor.runtime.coordinate_descent_tuner import CoordescTuner

    original = getattr(CoordescTuner.compare_config, "__wrapped__", CoordescTuner.compare_config)
    compare = pt.follow_the_tuner(original) if follow else original
    monkeypatch.setattr(CoordescTuner, "compare_config", compare)
    tuned = []

    def bench(config):
        tuned.append(config)
        return abs(config.kwargs["XBLOCK"] - 4096) / 256 + config.num_warps

    tuner = kernel.coordesc_tuner
    tuner.cached_benchmark_results = {}
    start = kernel.configs[0]
    chosen = tuner.autotune(bench, start, bench(start))
    return tuned, chosen


def test_following_the_tuner_sends_every_configuration_it_then_tries(kernel, pool, monkeypatch):
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable as key

    pt.send(launched(kernel, kernel.configs[0]))
    first_round = len(pool.tasks)
    tuned, chosen = descend(kernel, monkeypatch, follow=True)
    sent = [key(args[2]) for _, args in pool.tasks]
    assert len(sent) > first_round  # the tuner moved, and the new configurations' neighbours went
    assert len(sent) == len(set(sent))  # none twice
    assert all(key(c) in sent for c in tuned[1:])  # the start was compiled by inductor
    assert key(chosen) != key(kernel.configs[0])


def test_what_the_tuner_tries_and_chooses_is_unchanged(kernel, pool, monkeypatch):
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable as key

    plain, plain_choice = descend(kernel, monkeypatch, follow=False)
    pt.send(launched(kernel, kernel.configs[0]))
    followed, followed_choice = descend(kernel, monkeypatch, follow=True)
    assert [key(c) for c in followed] == [key(c) for c in plain]
    assert key(followed_choice) == key(plain_choice)


def test_the_tuner_waits_for_a_candidate_under_way(kernel, monkeypatch):
    import threading
    import time

    from torch._inductor.async_compile import AsyncCompile

    futures = Futures()
    monkeypatch.setattr(AsyncCompile, "process_pool", staticmethod(lambda: futures))
    pt.send(launched(kernel, kernel.configs[0]))
    config, future = futures.tasks[0]
    threading.Timer(0.2, futures.finish).start()  # the workers finish all in 0.2 s
    began = time.perf_counter()
    assert pt.wait_for(kernel.coordesc_tuner, config) and future.done()
    assert time.perf_counter() - began >= 0.15
    assert not pt.wait_for(kernel.coordesc_tuner, config)  # compiled: nothing to wait for


def test_a_candidate_queued_behind_more_than_the_workers_take_is_left_to_the_tuner(
    kernel, monkeypatch
):
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    futures = Futures()
    monkeypatch.setattr(AsyncCompile, "process_pool", staticmethod(lambda: futures))
    pt.send(launched(kernel, kernel.configs[0]))
    assert len(futures.tasks) >= 3
    monkeypatch.setattr(inductor_config, "compile_threads", 2)
    try:
        last, _ = futures.tasks[-1]  # two or more ahead of it, two workers
        assert not pt.wait_for(kernel.coordesc_tuner, last)
        futures.tasks[0][1].set_result(True)
        futures.tasks[1][1].set_result(True)
        futures.tasks[-1][1].set_result(True)
        assert not pt.wait_for(kernel.coordesc_tuner, last)  # done: loaded, not waited for
    finally:
        futures.finish()


def test_off_with_the_environment_variable(monkeypatch):
    from torch._inductor.runtime import triton_heuristics as th

    before = th.CachingAutotuner.precompile
    monkeypatch.setenv(pt.ENV, "0")
    assert not pt.compile_tuning_candidates_ahead()
    assert th.CachingAutotuner.precompile is before


def test_on_wraps_precompile_once_where_inductor_has_workers(monkeypatch):
    from torch._inductor import config
    from torch._inductor.runtime import triton_heuristics as th

    # inductor's own, though an earlier test's compiled step may have wrapped it already
    now = th.CachingAutotuner.precompile
    original = getattr(now, "__wrapped__", now)
    monkeypatch.setattr(th.CachingAutotuner, "precompile", original)  # restored afterwards
    monkeypatch.delenv(pt.ENV, raising=False)
    monkeypatch.setattr(config, "compile_threads", 1)  # inductor compiles in this process only
    assert not pt.compile_tuning_candidates_ahead()
    assert th.CachingAutotuner.precompile is original
    monkeypatch.setattr(config, "compile_threads", 4)
    assert pt.compile_tuning_candidates_ahead()
    wrapped = th.CachingAutotuner.precompile
    assert wrapped is not original
    assert pt.compile_tuning_candidates_ahead() and th.CachingAutotuner.precompile is wrapped


@pytest.mark.gpu
def test_compiled_function_tunes_with_candidates_ahead(monkeypatch):
    """The real pool and tuner: a compiled function with coordinate descent on sends its
    kernels' candidates, is tuned, and computes what eager does."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import utils
    from torch._inductor.runtime import triton_heuristics as th

    monkeypatch.delenv(pt.ENV, raising=False)
    monkeypatch.setattr(th.CachingAutotuner, "precompile", th.CachingAutotuner.precompile)
    if not pt.compile_tuning_candidates_ahead():
        pytest.skip("inductor compiles in this process only here (one compile thread)")

    def f(x, w, b):
        return torch.relu(x * w + b).sum(dim=0)

    x, w, b = (torch.randn(s, device="cuda") for s in ((8192, 512), (512,), (512,)))
    sent, benched = pt.candidates_sent(), counters["inductor"]["coordesc_tuning_bench"]
    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    with fresh():
        torch._dynamo.reset()
        got = torch.compile(f, options={"coordinate_descent_tuning": True})(x, w, b)
    assert pt.candidates_sent() > sent
    assert counters["inductor"]["coordesc_tuning_bench"] > benched
    torch.testing.assert_close(got, f(x, w, b), rtol=1e-4, atol=1e-3)
