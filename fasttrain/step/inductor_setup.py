"""What fasttrain arranges in inductor before it compiles anything, and the one ``torch.compile``
call of every place that compiles (the training step, evaluation), so that each gets the same
fixes and the same handling of dynamo's saved trace."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from fasttrain.errors import first_line
from fasttrain.step.parallel_tuning import compile_tuning_candidates_ahead
from fasttrain.step.torch_fixes import (
    find_tuning_in_this_cache,
    keep_coordinate_descent_mark_in_copies,
    keep_coordinate_descent_results,
    share_ptxas_with_compile_workers,
)

log = logging.getLogger("fasttrain")


def prepare_inductor() -> None:
    """Apply, once per process and where they apply: the warm-start fixes for coordinate
    descent (``torch_fixes``: torch 2.11's lost mark on a loaded kernel, Triton's on a pickled
    config, and a loaded kernel's tuned config looked up in this process's cache), one
    ``ptxas`` for this process and inductor's compile workers (``torch_fixes``; before anything
    compiles), and the tuning's candidates compiled ahead in those workers
    (``parallel_tuning``)."""
    keep_coordinate_descent_results()  # torch 2.11's warm starts re-tune without it
    keep_coordinate_descent_mark_in_copies()  # else a worker's warm kernel is tuned again
    find_tuning_in_this_cache()  # else a cache filled from elsewhere is tuned again
    share_ptxas_with_compile_workers()  # else no compile here hits the workers' kernels
    compile_tuning_candidates_ahead()  # the tuning's compiles in inductor's workers


def compile_function(
    fn: Callable[..., Any], options: dict[str, Any] | None, *, what: str, keep_trace: bool
) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=False, **options)`` after ``prepare_inductor``.

    ``keep_trace``: dynamo's trace of ``fn`` may be saved and loaded (caching precompile, where
    ``run/compile_cache.py`` turned it on). False compiles without it. With it, a saved trace
    that cannot be loaded is not fatal: ``torch.compile`` looks the trace up as it wraps
    ``fn``, and torch 2.11 catches only a ``RuntimeError`` there. A trace of evaluation saved
    after training steps failed to load on the GPU with a ``TypeError`` from its guards'
    state. So any failure there compiles ``fn`` afresh, without the saved trace, and says
    so. ``what``: ``fn`` in that message."""
    import torch._dynamo.config as dynamo_config

    prepare_inductor()
    options = options or {}
    if keep_trace and dynamo_config.caching_precompile:
        try:
            return torch.compile(fn, dynamic=False, **options)
        except Exception as e:  # the saved trace, read as torch.compile wraps fn
            log.warning(
                "dynamo's saved trace of %s could not be loaded (%s: %s); tracing it afresh "
                "(--no-trace-cache skips the lookup)",
                what,
                type(e).__name__,
                first_line(str(e)),
            )
    with dynamo_config.patch(caching_precompile=False):
        return torch.compile(fn, dynamic=False, **options)
