"""CUDA-graph mechanics shared by the graphed train step and graphed evaluation: warm-up on a
side stream, capture that leaves the current stream as it found it, and the one-line account of
what broke a capture."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from fasttrain.errors import first_line
from fasttrain.step import graph_memsets

T = TypeVar("T")
log = logging.getLogger("fasttrain")
_memset_failure_told = False


def on_side_stream(fn: Callable[[], T], side: torch.cuda.Stream) -> T:
    """Run ``fn`` on ``side``, ordered after the current stream's work and before its next."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return out


def capture(
    fn: Callable[[], T], side: torch.cuda.Stream, generators: Sequence[torch.Generator] = ()
) -> tuple[torch.cuda.CUDAGraph, T]:
    """Record ``fn`` (not run it) in a new CUDA graph on ``side``; returns the graph and what
    ``fn`` returned (tensors the replays refill). ``generators``: CUDA generators of fn's own
    besides the default one, registered so that every replay draws new numbers from them. On
    failure the exception propagates, with the current stream restored: a failed capture can
    leave the capture stream current."""
    current = torch.cuda.current_stream()
    graph, rewrite = _new_graph()
    for generator in generators:
        graph.register_generator_state(generator)
    try:
        # thread_local: DALI's worker threads keep using CUDA while this thread captures
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            out = fn()
    except Exception:
        torch.cuda.set_stream(current)
        raise
    if rewrite:
        _memsets_as_kernels(graph)
        graph.instantiate()
    return graph, out


def _new_graph() -> tuple[torch.cuda.CUDAGraph, bool]:
    """A graph to capture into, and whether its memsets are to be replaced: then it is kept
    uninstantiated after capture (``keep_graph``; a torch without it captures as before)."""
    if graph_memsets.enabled():
        try:
            return torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:
            pass
    return torch.cuda.CUDAGraph(), False


def _memsets_as_kernels(graph: torch.cuda.CUDAGraph) -> None:
    """``graph_memsets.as_kernels`` on a captured graph; a failure leaves the graph computing
    the same (a run is replaced whole or not at all), so it is reported once and not raised."""
    global _memset_failure_told
    try:
        n = graph_memsets.as_kernels(graph.raw_cuda_graph())
        log.debug("CUDA graph: %d memsets replaced by fill kernels", n)
    except Exception as e:
        if not _memset_failure_told:
            _memset_failure_told = True
            log.warning(
                "CUDA graph: its memsets stay as they are (%s); %s=keep skips trying",
                first_line(str(e)),
                graph_memsets.ENV,
            )


def blame(e: BaseException) -> str:
    """The first failure in ``e``'s chain and the innermost source line that raised it."""
    root = e
    while root.__context__ is not None and root.__context__ is not root:
        root = root.__context__
    frames = traceback.extract_tb(root.__traceback__)
    message = first_line(str(root))
    if not frames:
        return f"{type(root).__name__}: {message}"
    f = frames[-1]
    return f"{type(root).__name__}: {message} at {f.filename}:{f.lineno} ({f.name}: {f.line})"
