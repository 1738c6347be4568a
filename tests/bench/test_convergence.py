"""bench/convergence.py on the CPU: both paths trained from one seed on the tiny set, their
curves read back into the table, the JSON and the plot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location(
    "bench_convergence", REPO / "bench" / "convergence.py"
)
convergence = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(convergence)


@pytest.mark.slow
def test_both_paths_train_and_are_tabled_and_plotted(tiny_data, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "conv"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "convergence.py"), "--set", str(tiny_data),
         "--seeds", "0", "--concurrent", "2", "--out", str(out), "--", "--device", "cpu",
         "--arch", "resnet18", "--image-size", "32", "--batch-size", "16", "--workers", "1",
         "--epochs", "2", "--no-compile", "--loader", "torchvision"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    name = Path(tiny_data).name
    runs = json.loads((out / "curves.json").read_text())
    assert set(runs) == {f"{name}-fused-s0", f"{name}-plain-s0"}
    for c in runs.values():
        assert len(c["top1"]) == 2 and c["nonfinite"] == 0 and len(c["loss"]) >= 2
        assert c["loss_scale"] == [None] * len(c["loss"])  # no fp16 on the CPU
    # the same seed, the same weights: the fused reference follows the plain model
    fused, plain = runs[f"{name}-fused-s0"], runs[f"{name}-plain-s0"]
    assert fused["loss"] == pytest.approx(plain["loss"], rel=1e-3)
    table = (out / "convergence.md").read_text()
    assert f"| {name}-fused-s0 |" in table and f"**{name}-plain**, 1 seeds" in table
    assert (out / "convergence.png").stat().st_size > 10_000


def test_the_table_averages_the_last_epochs_and_names_a_failed_run():
    ok = {"step": [1, 2], "loss": [2.0, 1.5], "nonfinite": 0, "loss_scale": [65536.0, 32768.0],
          "skipped": 1, "epoch": [0, 1, 2, 3], "top1": [10.0, 50.0, 60.0, 70.0]}  # fmt: skip
    text = convergence.table({"s-fused-s0": ok, "s-fused-s1": {"top1": []}})
    assert "| s-fused-s0 | 1.5000 | 70.00% | 60.00% | 0 | 1 | 32,768-65,536 |" in text
    assert "| s-fused-s1 | failed |" in text and "**s-fused**, 1 seeds" in text
