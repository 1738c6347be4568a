"""What fasttrain arranges in inductor before it compiles anything: one call for every place that
calls ``torch.compile`` (the training step, evaluation), so that each gets the same fixes."""

from __future__ import annotations

from fasttrain.step.parallel_tuning import compile_tuning_candidates_ahead
from fasttrain.step.torch_fixes import (
    keep_coordinate_descent_results,
    share_ptxas_with_compile_workers,
)


def prepare_inductor() -> None:
    """Apply, once per process and where they apply: torch 2.11's warm-start fix for coordinate
    descent (``torch_fixes``), one ``ptxas`` for this process and inductor's compile workers
    (``torch_fixes``; before anything compiles), and the tuning's candidates compiled ahead in
    those workers (``parallel_tuning``)."""
    keep_coordinate_descent_results()  # torch 2.11's warm starts re-tune without it
    share_ptxas_with_compile_workers()  # else no compile here hits the workers' kernels
    compile_tuning_candidates_ahead()  # the tuning's compiles in inductor's workers
