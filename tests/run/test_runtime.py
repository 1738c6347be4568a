"""The run's logging: Python's warnings go into the run's log, above the progress bar, and the
CPU's log speaks of processes, not GPUs."""

from __future__ import annotations

import json

import torch

from tests.conftest import FAST


def test_python_warnings_go_into_the_log_and_above_the_progress_bar(tmp_path, capsys):
    """A torch warning printed onto the bar's line broke it: warnings take the log's handlers
    (the rank's file, and tqdm.write on the console)."""
    import logging
    import warnings

    from fasttrain.dist.state import DistState
    from fasttrain.run.runtime import setup_logging

    setup_logging(tmp_path, DistState(0, 0, 1, torch.device("cpu")))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a warning raised mid-run", UserWarning, stacklevel=1)
    for h in logging.getLogger("fasttrain").handlers:
        h.flush()
    assert "UserWarning: a warning raised mid-run" in (tmp_path / "log-rank0.txt").read_text()
    assert "a warning raised mid-run" in capsys.readouterr().err


def test_the_cpu_log_speaks_of_processes_and_leaves_gpu_memory_out(run, tiny_data, tmp_path):
    out = tmp_path / "cpu"
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "2", "--eval-every", "0",
                    "--output-dir", out)  # fmt: skip
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert "global batch 16 (16 per process x 1 process x 1 accum)" in log
    assert "GPU" not in log and "peak memory" not in log

    assert json.loads((out / "summary.json").read_text())["peak_mem_gib"] is None
