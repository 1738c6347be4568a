"""``--tune-kernels later`` (step/late_tuning.py): a kernel's tuning put off at its first call
runs the starting launcher and waits; the tuning is due once the compile workers are done; when
it begins, the graphs are dropped and the kernels tune at their next call. On the CPU with
inductor's own kernel object (``kernel_source``) and a stand-in for the tuning; the GPU test
trains a compiled, graphed step through the whole switch."""

from __future__ import annotations

import copy
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fasttrain.step import late_tuning as lt
from fasttrain.step import parallel_tuning as pt
from tests.step.kernel_source import launched


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Nothing put off and no candidate under way before each test; inductor's tuning as it
    was after it."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    original = CachingAutotuner.coordinate_descent_tuning
    monkeypatch.setattr(CachingAutotuner, "coordinate_descent_tuning", original)
    monkeypatch.setattr(lt, "_waiting", type(lt._waiting)())
    monkeypatch.setattr(pt, "_in_flight", {})
    monkeypatch.setattr(pt, "_held", None)
    yield
    lt.defer(False)


class Tuner:
    """A stand-in for inductor's coordinate descent: records its calls, returns a tuned
    launcher (its config marked as coordinate descent marks it)."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel, launcher, *args, **kwargs):
        self.calls.append((kernel, launcher, args))
        config = copy.deepcopy(launcher.config)
        config.found_by_coordesc = True
        return SimpleNamespace(config=config)


def test_a_kernel_put_off_runs_its_starting_launcher_until_tuning_is_allowed(kernel):
    tuner = Tuner()
    tune = lt.put_off(tuner)
    start = launched(kernel, kernel.configs[0]).launchers[0]
    lt.defer(True)
    assert tune(kernel, start, 1, 2) is start and tune(kernel, start, 1, 2) is start
    assert tuner.calls == [] and lt.waiting() == 1
    lt.defer(False)
    tuned = tune(kernel, start, 1, 2)
    assert tuner.calls == [(kernel, start, (1, 2))] and tuned.config.found_by_coordesc
    kernel.launchers = [tuned]  # as inductor's run() keeps it
    assert lt.waiting() == 0


def test_a_kernel_that_will_not_be_tuned_is_never_put_off(kernel):
    tuner = Tuner()
    tune = lt.put_off(tuner)
    found = copy.deepcopy(kernel.configs[0])
    found.found_by_coordesc = True  # the autotune cache's choice: nothing to tune
    lt.defer(True)
    tune(launched(kernel, found), kernel.launchers[0])
    assert len(tuner.calls) == 1 and lt.waiting() == 0  # handed to inductor, which returns it


def test_allowing_the_tuning_makes_a_kernels_next_call_ask_again(kernel):
    """torch 2.12 and later keep the launcher of a kernel's first call and launch it without
    asking whether to tune; a kernel put off must ask again once tuning is allowed."""
    tune = lt.put_off(Tuner())
    lt.defer(True)
    tune(launched(kernel, kernel.configs[0]), kernel.launchers[0])
    kernel._cached_launcher = kernel.launchers[0]  # what torch keeps after the first call
    lt.defer(False)
    assert kernel._cached_launcher is None


def test_inductors_run_launches_the_starting_kernel_until_the_tuning_then_the_tuned_one(
    kernel, monkeypatch
):
    """Inductor's own ``CachingAutotuner.run``, this torch's (2.12 and later keep the first
    call's launcher and launch it without asking again), with its tuning through ``put_off``
    and a stand-in for coordinate descent: the starting kernel while the tuning is put off,
    the tuned one from the first call after it is allowed."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    launches = []

    def launcher(name, config):
        def launch(*args, stream):
            launches.append(name)

        launch.config, launch.cache_hash, launch.store_cubin = config, name, False
        return launch

    def tune(self, start, *args, **kwargs):
        config = copy.deepcopy(start.config)
        config.found_by_coordesc = True
        return launcher("tuned", config)

    monkeypatch.setattr(CachingAutotuner, "coordinate_descent_tuning", lt.put_off(tune))
    kernel.launchers = [launcher("start", kernel.configs[0])]
    lt.defer(True)
    for _ in range(3):
        kernel.run(1, 2, stream=0)
    lt.defer(False)
    for _ in range(2):
        kernel.run(1, 2, stream=0)
    assert launches == ["start"] * 3 + ["tuned"] * 2
    assert lt.waiting() == 0


def test_install_routes_inductors_tuning_through_it_once(kernel, monkeypatch):
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    original = CachingAutotuner.coordinate_descent_tuning
    lt.install()
    lt.install()
    wrapped = CachingAutotuner.coordinate_descent_tuning
    assert wrapped.fasttrain_later and wrapped.__wrapped__ is original
    lt.defer(True)
    start = launched(kernel, kernel.configs[0]).launchers[0]
    assert kernel.coordinate_descent_tuning(start) is start and lt.waiting() == 1


class Graph:
    def __init__(self):
        self.recaptured = 0

    def recapture(self):
        self.recaptured += 1


def test_the_tuning_is_due_once_the_workers_have_compiled_the_candidates(
    kernel, monkeypatch, caplog
):
    from concurrent.futures import Future

    from torch._inductor.async_compile import AsyncCompile

    futures = []

    def submit(fn, *args):
        futures.append(Future())
        return futures[-1]

    pool = SimpleNamespace(submit=submit)
    monkeypatch.setattr(AsyncCompile, "process_pool", staticmethod(lambda: pool))
    late = lt.LateTuning()
    assert not late.due()  # nothing put off yet
    launched(kernel, kernel.configs[0])
    held = pt.send(kernel)  # at the kernel's load: its candidates wait for the first step
    kernel.coordinate_descent_tuning(kernel.launchers[0])  # its first call: put off
    assert held and not futures and lt.waiting() == 1
    assert pt.candidates_compiling() == held  # held back, so not compiled yet
    assert not late.due()  # asked after the first step: the candidates go to the workers
    assert len(futures) == held and pt.candidates_sent() >= held
    assert not late.due()  # the workers are compiling
    for f in futures[:-1]:
        f.set_result(True)
    assert not late.due()
    futures[-1].set_result(False)  # one that did not compile: done all the same
    assert late.due()
    graphs = [Graph(), Graph()]
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        late.begin(7, graphs)
    assert [g.recaptured for g in graphs] == [1, 1] and not late.due()
    assert "the 1 kernels put off tune at their next call (the training step's in step 7" in (
        caplog.text
    )
    late.done(torch.device("cpu"), time.perf_counter() - 0.25)
    record = late.close()
    assert record["step"] == 7 and record["kernels"] == 1 and record["seconds"] >= 0.25


def test_without_compile_workers_the_tuning_is_due_at_once(kernel):
    late = lt.LateTuning()
    kernel.coordinate_descent_tuning(launched(kernel, kernel.configs[0]).launchers[0])
    assert late.due()


def test_a_start_that_put_nothing_off_has_no_record():
    assert lt.LateTuning().close() is None  # a warm start: every kernel tuned from the cache


def test_a_run_that_ends_before_the_tuning_says_how_many_kernels_wait(kernel, caplog):
    late = lt.LateTuning()
    kernel.coordinate_descent_tuning(launched(kernel, kernel.configs[0]).launchers[0])
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        assert late.close() == {"step": None, "kernels": 1}
    assert "ended before its kernels were tuned (1 wait)" in caplog.text
    assert not late.due()  # closed: nothing is put off any more


def test_tunes_kernels_follows_the_resolved_flags():
    from tests.config.test_config import resolved

    assert lt.tunes_kernels(resolved(["--data", "/d", "--compile"]))  # auto: tuned
    default = ["--compile-mode", "default"]
    assert not lt.tunes_kernels(resolved(["--data", "/d", "--compile", *default]))
    assert not lt.tunes_kernels(resolved(["--data", "/d"]))
    assert not lt.tunes_kernels(resolved(["--data", "/d", "--compile"], cuda=False))
    assert lt.tunes_kernels(
        resolved(["--data", "/d", "--compile", "--compile-mode", "max-autotune-no-cudagraphs"])
    )


@pytest.mark.gpu
def test_a_graphed_step_trains_untuned_then_tunes_and_is_captured_again(caplog):
    """A small compiled, graphed step with coordinate descent on and nothing cached: its kernels
    train untuned and captured; once the workers are done the tuning step tunes every one, the
    step is captured again, and the losses follow the eager step's throughout."""
    from fasttrain.config import OptimConfig
    from fasttrain.metrics.meter import DeviceMeter
    from fasttrain.step.optim import build_optimizer, build_schedule
    from fasttrain.step.step import GraphedStep, build_step

    dev = torch.device("cuda")

    def make(compile: bool):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 24, 3, padding=1), nn.BatchNorm2d(24), nn.ReLU(),
            nn.Conv2d(24, 40, 3, stride=2, padding=1), nn.BatchNorm2d(40), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(40, 7),
        ).to(dev, memory_format=torch.channels_last)  # fmt: skip
        schedule = build_schedule(OptimConfig(warmup_epochs=0), 16, 20, 2)
        options = {"options": {"coordinate_descent_tuning": True, "autotune_local_cache": False}}
        return model, build_step(
            model=model,
            optimizer=build_optimizer(model, OptimConfig(), schedule.lr_at(0)),
            criterion=nn.CrossEntropyLoss(),
            amp_dtype=torch.bfloat16,
            scaler=None,
            schedule=schedule,
            compile=compile,
            compile_options=options if compile else None,
            cuda_graphs=compile,
        )

    g = torch.Generator().manual_seed(1)
    nhwc = torch.channels_last
    data = [
        (torch.randn(16, 3, 20, 20, generator=g).to(dev).contiguous(memory_format=nhwc),
         torch.randint(0, 7, (16,), generator=g).to(dev))
        for _ in range(12)
    ]  # fmt: skip

    def train(step, meter, batches, first):
        losses = []
        for i, batch in enumerate(batches):
            step([batch], meter, first + i)
            losses.append(meter.flush()[0])
        return losses

    _, eager = make(False)
    ref = train(eager, DeviceMeter(dev), data, 0)
    late = lt.LateTuning()
    try:
        _, step = make(True)
        assert isinstance(step, GraphedStep)
        meter = DeviceMeter(dev)
        with caplog.at_level(logging.INFO, logger="fasttrain"):
            losses = train(step, meter, data[:6], 0)
            assert step.graph is not None and lt.waiting() > 0  # captured, untuned
            put_off = list(lt._waiting)
            deadline = time.monotonic() + 300
            while not late.due():
                assert time.monotonic() < deadline, "the compile workers never finished"
                time.sleep(0.2)
            late.begin(7, [step])
            losses += train(step, meter, data[6:], 6)
        assert lt.waiting() == 0 and step.graph is not None
        assert all(k.launchers[0].config.found_by_coordesc for k in put_off)
        captures = [r for r in caplog.records if "captured the training step" in r.getMessage()]
        assert len(captures) == 2
        assert losses == pytest.approx(ref, rel=5e-2)
    finally:
        late.close()
