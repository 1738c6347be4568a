"""What every cuDNN frontend graph here needs: whether the frontend is installed, one handle per
device, the fastest of the plans cuDNN ranks, and a launch on torch's current stream.

``cudnn_conv_bn`` (convolution with BatchNorm folded in) and ``cudnn_bn`` (cuDNN's standalone
BatchNorm + add + ReLU kernels) build their graphs on these. The frontend
(``nvidia-cudnn-frontend``) is one of fasttrain's dependencies on Linux; nothing here imports it
until a graph is built.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from fasttrain.model.cudnn import plans_kept

log = logging.getLogger(__name__)
_handles: dict[int, Any] = {}


def available() -> bool:
    """Whether the cuDNN frontend is installed."""
    return importlib.util.find_spec("cudnn") is not None


def version() -> int | None:
    """cuDNN's version as the frontend reports it (91900 for 9.19), or None without it."""
    if not available():
        return None
    import cudnn

    return int(cudnn.backend_version())


def handle(device: torch.device) -> Any:
    """The cuDNN handle for ``device``, created once."""
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    return _handles[index]


_selecting_s = 0.0  # what select_fastest has cost so far in this process


def selection_seconds() -> float:
    """Seconds spent in ``select_fastest`` so far in this process: the cuDNN part of a run's
    start-up."""
    return _selecting_s


def select_fastest(
    graph: Any,
    run: Callable[[int], None],
    limit: int | None = None,
    key: tuple | None = None,
    device: torch.device | None = None,
) -> None:
    """``_select_fastest``, timed (``selection_seconds``). With ``key`` (the graph's shapes,
    strides, types and fusions) and ``device``, the plan a start chose is kept
    (``plans_kept``), and a later start with the same key builds that plan alone."""
    global _selecting_s
    t0 = time.perf_counter()
    try:
        if key is None or device is None or torch.cuda.is_current_stream_capturing():
            _select_fastest(graph, run, limit)
            return
        full = plans_kept.full_key(key, device)
        count = graph.get_execution_plan_count()
        index = plans_kept.kept_plan(full, count)
        if index is not None and _builds(graph, index):
            return
        plans_kept.keep(full, _select_fastest(graph, run, limit), count)
    finally:
        _selecting_s += time.perf_counter() - t0


def _builds(graph: Any, index: int) -> bool:
    """Whether plan ``index`` builds (it is then the graph's plan)."""
    try:
        graph.build_plan_at_index(index)
    except Exception:  # cudnn raises its own types; any of them means "time them again"
        return False
    return True


REPEATS = 3  # executions timed per plan


def _select_fastest(graph: Any, run: Callable[[int], None], limit: int | None) -> int | None:
    """Build the plans cuDNN ranks for ``graph`` (every one, or the first ``limit`` that run and
    capture), time ``run(workspace_bytes)`` (one execution with that plan) on each, and keep the
    fastest that also captures in a CUDA graph (its index returned), as ``cudnn.benchmark`` does for
    torch's convolutions: the heuristics' first choice was several times slower than the bare
    convolution for some shapes. Building a plan compiles its kernel (about 0.3 s each; cuDNN ranks
    30-36 plans for a BN graph), hence ``limit``. Under a CUDA-graph capture nothing can be timed:
    the heuristics' first plan that builds is kept. Each plan is timed over ``REPEATS`` eager
    executions; timing them by the replay of a CUDA graph instead, as the step runs them, made the
    step no faster (docs/experiments/2026-12-step-options.md)."""
    if torch.cuda.is_current_stream_capturing():
        graph.build_plans()
        return None
    best, best_ms, tried = None, float("inf"), 0
    for index in range(graph.get_execution_plan_count()):
        if limit is not None and tried >= limit:
            break
        try:
            graph.build_plan_at_index(index)
        except Exception:  # a declined engine: try the next
            continue
        workspace = graph.get_workspace_size()
        try:
            run(workspace)
            ms = _eager_ms(run, workspace)
        except Exception:  # a plan that builds but does not run: the next
            continue
        if ms is None:  # the step replays it from a CUDA graph
            log.debug(
                "cuDNN plan %d of %d runs but does not capture",
                index,
                graph.get_execution_plan_count(),
            )
            continue
        tried += 1
        if ms < best_ms:
            best, best_ms = index, ms
    if best is None:
        raise RuntimeError("no plan of the graph builds")
    graph.build_plan_at_index(best)
    return best


def _eager_ms(run: Callable[[int], None], workspace: int) -> float | None:
    """GPU milliseconds of ``REPEATS`` eager executions, or None where one does not capture."""

    def launches() -> None:
        for _ in range(REPEATS):
            run(workspace)

    ms = _gpu_ms(launches)
    return ms if _capture(run, workspace, 1) is not None else None


def _gpu_ms(work: Callable[[], object]) -> float:
    """GPU milliseconds of what ``work`` launches on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _capture(run: Callable[[int], None], workspace: int, times: int) -> torch.cuda.CUDAGraph | None:
    """``times`` executions captured in a CUDA graph, or None where they do not capture. Some
    engines cuDNN ranks run eagerly but fail under capture (the whole capture is then invalid),
    and the trainer replays its step, these launches included, from a CUDA graph.
    Thread-local, so other threads' CUDA work (DALI's) goes on meanwhile."""
    captured = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(captured, capture_error_mode="thread_local"):
            for _ in range(times):
                run(workspace)
    except Exception:
        return None
    return captured


def execute(graph: Any, binds: dict, workspace_bytes: int, device: torch.device) -> None:
    """Launch ``graph`` on torch's current stream with ``binds`` (graph tensor -> torch tensor),
    its workspace from torch's allocator: so the launch is capturable in a CUDA graph."""
    import cudnn

    workspace = torch.empty(max(1, workspace_bytes), dtype=torch.uint8, device=device)
    h = handle(device)
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(device).cuda_stream)
    graph.execute(binds, workspace, handle=h)
