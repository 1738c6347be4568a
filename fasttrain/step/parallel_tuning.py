"""Coordinate descent's candidate kernels compiled in inductor's worker processes, ahead of the
tuner that benchmarks them.

Inductor's coordinate-descent tuning (``--compile-mode auto``) tunes each Triton kernel at its
first call, in the training process and one configuration at a time: compile a neighbouring
configuration (block sizes, warps), benchmark it, move on. Compiling needs no GPU, and inductor's
compile workers sit idle by then. So as soon as a kernel that will be tuned is loaded, this sends
the configurations its tuning is likely to try (each tunable field one and two steps either side
of where it starts) to those workers, and each time the tuner moves to a better configuration,
that one's neighbours too. The workers compile them into Triton's on-disk cache. The tuner, about
to compile a candidate that a worker is compiling now, waits for it and then loads the result
instead of compiling it (which needs both processes on one ``ptxas``:
``torch_fixes.share_ptxas_with_compile_workers``). What the tuner benchmarks and chooses is
unchanged: a candidate not sent, or still queued behind others, is compiled by the tuner as
before. ``FASTTRAIN_PARALLEL_TUNING=0`` turns this off. Figures: BENCHMARKS.md, start-up."""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import os
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("fasttrain")

ENV = "FASTTRAIN_PARALLEL_TUNING"
# inductor passes these to its workers with each task, as they may change while the pool runs
WORKER_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")
RADIUS = 2  # one step either side is the tuner's first round; two covers a second along a field
WAIT_S = 60.0  # for a worker's compile under way; only a worker that died takes this long


@dataclass
class _Kernel:
    """What a kernel's candidates need to be compiled elsewhere, and those sent so far."""

    name: str
    source: str
    env: dict[str, str]
    sent: dict[Any, tuple[int, Future | None]] = field(default_factory=dict)


_kernels: weakref.WeakKeyDictionary[Any, _Kernel] = weakref.WeakKeyDictionary()
_in_flight: dict[int, Future] = {}  # by order sent: the pool runs them first come, first served
_order = itertools.count()
_sent = 0
_held: list[tuple[_Kernel, Any, Any]] | None = None  # (kernel, key, config) while held back


def candidates_sent() -> int:
    """How many candidate configurations this process has sent to the compile workers."""
    return _sent


def candidates_compiling() -> int:
    """How many candidates sent to the compile workers, or held back, are not compiled yet."""
    for done in [k for k, f in _in_flight.items() if f.done()]:
        del _in_flight[done]
    return len(_in_flight) + len(_held or ())


def hold(on: bool = True) -> None:
    """Keep the candidates from the compile workers until ``release``, so that the step's own
    kernels, which the first step waits for, are not queued behind them (True); or send the
    next ones at once again, and those held never (False: the tuner compiles its own)."""
    global _held
    _held = (_held or []) if on else None


def release() -> int:
    """Send the candidates held back since ``hold`` to the compile workers, and send the
    next ones at once again; returns how many were sent."""
    global _held
    held, _held = _held or [], None
    for kernel, key, config in held:
        _submit(kernel, key, config)
    return len(held)


def compile_tuning_candidates_ahead() -> bool:
    """Send the candidates of each kernel that coordinate descent will tune to inductor's
    compile workers when the kernel is loaded, and more as the tuner moves. Returns whether it
    is in effect: not with ``FASTTRAIN_PARALLEL_TUNING=0``, on a torch without inductor's Triton
    runtime, or where inductor compiles in this process only (one compile thread)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        from torch._inductor.async_compile import get_compile_threads
        from torch._inductor.runtime import triton_heuristics as th
        from torch._inductor.runtime.coordinate_descent_tuner import CoordescTuner
    except ImportError:
        return False
    if get_compile_threads() <= 1:
        return False
    if not getattr(CoordescTuner.compare_config, "fasttrain_follows", False):
        CoordescTuner.compare_config = follow_the_tuner(CoordescTuner.compare_config)
    original = th.CachingAutotuner.precompile
    if getattr(original, "fasttrain_ahead", False):
        return True

    @functools.wraps(original)
    def precompile(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if not kwargs.get("warm_cache_only", args[0] if args else False):
            try:
                send(self)
            except Exception as e:  # the tuner compiles what was not sent: slower, not wrong
                log.debug("tuning candidates not compiled ahead: %s", e)
        return out

    precompile.fasttrain_ahead = True  # type: ignore[attr-defined]
    th.CachingAutotuner.precompile = precompile
    return True


def follow_the_tuner(compare_config: Any) -> Any:
    """``CoordescTuner.compare_config`` that waits for a candidate a worker is compiling before
    the tuner compiles it too, and sends the neighbours of each better configuration it finds."""

    @functools.wraps(compare_config)
    def compare(self: Any, func: Any, candidate: Any, best: Any, best_timing: float) -> Any:
        try:
            wait_for(self, candidate)
        except Exception as e:  # the tuner compiles it itself: slower, not wrong
            log.debug("tuning candidate not waited for: %s", e)
        better, timing = compare_config(self, func, candidate, best, best_timing)
        if better:
            try:
                send_near(self, [candidate])
            except Exception as e:
                log.debug("tuning candidates not compiled ahead: %s", e)
        return better, timing

    compare.fasttrain_follows = True  # type: ignore[attr-defined]
    return compare


def will_tune(kernel: Any) -> bool:
    """Whether inductor's first call of ``kernel`` will run coordinate descent on it: its
    conditions in torch 2.11 (``CachingAutotuner.run``, ``coordinate_descent_tuning``)."""
    from torch._inductor.runtime.hints import HeuristicType

    if not kernel.inductor_meta.get("coordinate_descent_tuning") or not kernel.launchers:
        return False
    if kernel.heuristic_type in (
        HeuristicType.TEMPLATE,
        HeuristicType.USER_AUTOTUNE,
        HeuristicType.FIXED,
    ):
        return False
    reductions = (
        HeuristicType.REDUCTION,
        HeuristicType.PERSISTENT_REDUCTION,
        HeuristicType.SPLIT_SCAN,
    )
    if kernel.deterministic_mode and kernel.heuristic_type in reductions:
        return False
    # a configuration coordinate descent found (the autotune cache's) is not tuned again
    return not any(getattr(x.config, "found_by_coordesc", False) for x in kernel.launchers)


def candidates(tuner: Any, starts: Iterable[Any]) -> list[Any]:
    """The configurations near each of ``starts`` that ``tuner`` (a ``CoordescTuner``) may
    try: each tunable field moved up to ``RADIUS`` steps either way, one field at a time;
    neither the starts themselves nor duplicates."""
    from torch._inductor.runtime.coordinate_descent_tuner import get_field, set_field
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable

    starts = list(starts)
    seen = {triton_config_to_hashable(c) for c in starts}
    out = []
    for start in starts:
        for name in tuner.tunable_fields:
            value = get_field(start, name)
            if value is None:
                continue
            for near in tuner.get_neighbour_values(name, value, radius=RADIUS):
                config = copy.deepcopy(start)
                set_field(config, name, near)
                key = triton_config_to_hashable(config)
                if key in seen or not tuner.is_valid_config(config):
                    continue
                seen.add(key)
                out.append(config)
    return out


def send(kernel: Any) -> int:
    """Queue ``kernel``'s tuning candidates on inductor's compile workers; returns how many."""
    if not will_tune(kernel) or not kernel.filename:
        return 0
    if kernel.coordesc_tuner not in _kernels:
        name = kernel.inductor_meta.get("kernel_name") or kernel.fn.__name__
        env = {v: os.environ[v] for v in WORKER_ENV if v in os.environ}
        source = Path(kernel.filename).read_text()
        _kernels[kernel.coordesc_tuner] = _Kernel(name, source, env)
    return send_near(kernel.coordesc_tuner, (x.config for x in kernel.launchers))


def send_near(tuner: Any, starts: Iterable[Any]) -> int:
    """Queue the candidates near ``starts`` of a kernel ``send`` has seen, those not sent
    already, on the compile workers (or held back for them, after ``hold``); returns how
    many."""
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable

    kernel = _kernels.get(tuner)
    if kernel is None:
        return 0
    starts = list(starts)
    for start in starts:  # the starts were compiled by inductor or by the tuner already
        kernel.sent.setdefault(triton_config_to_hashable(start), (-1, None))
    configs = {triton_config_to_hashable(c): c for c in candidates(tuner, starts)}
    configs = {k: c for k, c in configs.items() if k not in kernel.sent}
    for key, config in configs.items():
        if _held is not None:
            kernel.sent[key] = (-1, None)  # the tuner compiles it itself if it comes first
            _held.append((kernel, key, config))
        else:
            _submit(kernel, key, config)
    return len(configs)


def _submit(kernel: _Kernel, key: Any, config: Any) -> None:
    """One candidate to the compile workers, in the order sent."""
    from torch._inductor.async_compile import AsyncCompile

    global _sent
    future = AsyncCompile.process_pool().submit(
        compile_candidate, kernel.name, kernel.source, config, kernel.env
    )
    order = next(_order)
    kernel.sent[key] = (order, future)
    if isinstance(future, Future):
        _in_flight[order] = future
    _sent += 1


def wait_for(tuner: Any, config: Any) -> bool:
    """Before the tuner compiles ``config``: wait for a worker's compile of it where one is
    under way, so that the tuner's compile loads it. A candidate still queued behind more
    than the workers can take at once is left to the tuner. Returns whether it waited."""
    from torch._inductor.async_compile import get_compile_threads
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable

    kernel = _kernels.get(tuner)
    if kernel is None:
        return False
    order, future = kernel.sent.get(triton_config_to_hashable(config), (-1, None))
    if future is None or future.done():
        return False
    candidates_compiling()  # forgets those done
    if sum(1 for k in _in_flight if k < order) >= get_compile_threads():
        return False
    try:
        future.result(timeout=WAIT_S)
    except Exception as e:  # a worker that failed: the tuner compiles it and sees why
        log.debug("waiting for a tuning candidate: %s", e)
    return True


def compile_candidate(name: str, source: str, config: Any, env: dict[str, str]) -> bool:
    """In a compile worker: compile kernel ``name`` of module ``source`` with ``config`` into
    Triton's cache, as the tuner's own compile would. Returns False where that configuration
    does not compile (too many registers or too much shared memory: the tuner skips it too)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path

    _set_triton_ptxas_path()
    os.environ.update(env)
    kernel = getattr(PyCodeCache.load(source), name)
    try:
        kernel._precompile_config(config)
    except Exception as e:
        log.debug("%s %s did not compile: %s", name, config, e)
        return False
    return True
