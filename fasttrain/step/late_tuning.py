"""``--tune-kernels later``: inductor's coordinate-descent tuning moved from the first step to a
step the loop chooses, so that a first start trains on the untuned kernels meanwhile.

With ``--compile-mode auto`` inductor tunes each Triton kernel at its first call, one after
another, and a first start's first step waits for all of it (BENCHMARKS.md, start-up: the larger
part of a cold start). ``later`` compiles the same kernels (the same cache entries, so a warm
start is the same either way) but puts each kernel's tuning off at its first call: the kernel
runs the configuration inductor starts the tuning from, as ``--compile-mode default`` runs it,
and the step's CUDA graph is captured on those. Inductor's compile workers meanwhile compile the
candidates the tuning will try (``parallel_tuning``). Once none is left to compile, the loop
lets the next step tune: every kernel put off tunes at its next call, as at a first step, with
the step's own tensors, its candidates loaded from Triton's cache, its result written to
inductor's cache; the CUDA graphs are captured again on the tuned kernels.

- **The same math.** A configuration changes how a kernel's work is split among threads, not
  what it computes; a reduction's split can change the order of its sums, so the results after
  the switch agree with a run that started tuned to rounding, not bit for bit.
  ``--deterministic`` tunes no reductions.
- **One process.** Each process of a job would reach the switch at a step of its own.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from fasttrain.config import Config
from fasttrain.step.parallel_tuning import candidates_compiling, hold, release, will_tune

log = logging.getLogger("fasttrain")

_waiting: weakref.WeakSet[Any] = weakref.WeakSet()  # kernels whose tuning was put off
_deferring = False


def tunes_kernels(cfg: Config) -> bool:
    """Whether ``cfg``'s compiled step runs coordinate descent on its Triton kernels where
    inductor's cache has no result for them: what ``--tune-kernels`` chooses the time of."""
    t = cfg.train
    if not (t.compile and t.device == "cuda"):
        return False
    inductor = cfg.typed.inductor
    if "coordinate_descent_tuning" in inductor:
        return bool(inductor["coordinate_descent_tuning"])
    from torch._inductor import list_mode_options

    return bool(list_mode_options(t.compile_mode).get("coordinate_descent_tuning"))


def install() -> None:
    """Route inductor's coordinate descent through ``put_off``, once per process. Nothing is
    put off until ``defer(True)``."""
    from torch._inductor.runtime import triton_heuristics as th

    original = th.CachingAutotuner.coordinate_descent_tuning
    if not getattr(original, "fasttrain_later", False):
        th.CachingAutotuner.coordinate_descent_tuning = put_off(original)


def put_off(tune: Any) -> Any:
    """``CachingAutotuner.coordinate_descent_tuning`` that, while ``defer(True)`` holds, hands
    back the kernel's starting launcher untuned and notes the kernel, instead of tuning it."""

    @functools.wraps(tune)
    def coordinate_descent_tuning(self: Any, launcher: Any, *args: Any, **kwargs: Any) -> Any:
        # a kernel put off comes back at every call until it is tuned (without a CUDA graph)
        if _deferring and (self in _waiting or will_tune(self)):
            _waiting.add(self)
            return launcher
        return tune(self, launcher, *args, **kwargs)

    coordinate_descent_tuning.fasttrain_later = True  # type: ignore[attr-defined]
    return coordinate_descent_tuning


def defer(on: bool) -> None:
    """Put the tuning of each kernel's first call off (True), or let the kernels put off tune at
    their next call (False)."""
    global _deferring
    _deferring = on
    if not on:
        for kernel in list(_waiting):
            # torch 2.12 and later keep a kernel's launcher after its first call and no longer
            # ask whether to tune it: let the next call ask again
            if getattr(kernel, "_cached_launcher", None) is not None:
                kernel._cached_launcher = None


def waiting() -> int:
    """How many kernels put off are still untuned."""
    return sum(1 for kernel in list(_waiting) if will_tune(kernel))


class Recapturable(Protocol):
    """A step or evaluation that may hold a CUDA graph of the kernels as they were."""

    def recapture(self) -> None: ...


class LateTuning:
    """The loop's side of ``--tune-kernels later``: put the tuning off from now, say when it
    is due, and what it took."""

    def __init__(self) -> None:
        install()
        defer(True)
        hold()  # the candidates wait for the first step: its own kernels compile first
        self.step: int | None = None  # the step that tuned, counted from 1
        self.kernels = 0
        self.seconds = 0.0

    def due(self) -> bool:
        """Whether the next step should tune: kernels wait for it and the compile workers have
        no candidate left to compile (without workers: at once). Asked after the first step,
        it first sends the candidates held back until then."""
        if not (_deferring and _waiting):  # the usual answer, at every step: no work
            return False
        if release():  # the first step is done: the workers compile the candidates now
            return False
        return candidates_compiling() == 0 and waiting() > 0

    def begin(self, step: int, graphs: Iterable[Recapturable]) -> None:
        """Let the kernels put off tune at their next call, in ``step``, and have ``graphs``
        captured again at their next call, on the tuned kernels."""
        self.step, self.kernels = step, waiting()
        defer(False)
        for graph in graphs:
            graph.recapture()
        log.info(
            "--tune-kernels later: the compile workers are done; the %d kernels put off tune "
            "at their next call (the training step's in step %d, evaluation's at the next "
            "evaluation), and both are captured again on them",
            self.kernels,
            step,
        )

    def done(self, device: torch.device, began: float) -> None:
        """The tuning step, begun at ``began`` (``time.perf_counter``), is over: a one-off sync
        to time it."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds = time.perf_counter() - began
        log.info("step %d, which tuned the step's kernels, took %.1f s", self.step, self.seconds)

    def close(self) -> dict[str, Any] | None:
        """Stop putting tuning off (whatever compiles after the run tunes as usual); returns
        the run summary's record: the step that tuned, or none and the kernels left untuned;
        None where no kernel was put off (a warm start: inductor's cache had every result)."""
        left = waiting() if self.step is None else 0
        defer(False)
        hold(False)
        if self.step is not None:
            return {"step": self.step, "kernels": self.kernels, "seconds": round(self.seconds, 3)}
        if not left:
            return None
        if left:
            log.info(
                "--tune-kernels later: the run ended before its kernels were tuned (%d wait); "
                "a later start with these flags tunes them",
                left,
            )
        return {"step": None, "kernels": left}
