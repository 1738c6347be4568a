"""What the profile tests share: one profiled CPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST


@pytest.fixture(scope="package")
def profiled_cpu_run(tiny_data, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A profiled CPU run, in a process of its own so that what torch's C++ side prints is
    seen; its folder and its completed process."""
    out = tmp_path_factory.mktemp("profiled") / "p"
    flags = ["--profile", "--profile-wait", "2", "--profile-warmup", "1", "--profile-active", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "fasttrain", "--data", str(tiny_data), *FAST, "--max-steps", "8",
         "--eval-every", "0", "--output-dir", str(out), *flags],
        cwd=out.parent, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"},
    )  # fmt: skip
    return out, done
