"""bench/startup.py runs the starts asked for, in order, and tables each run's summary."""

import importlib.util
import sys
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_startup", Path(__file__).parents[2] / "bench" / "startup.py"
)
startup = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(startup)

SUMMARY = {
    "startup": {
        "total_s": 12.5,
        "parts_s": {"imports": 8.0, "model": 3.0, "first step": 1.5},
        "fx_graph_cache": {"hits": 2, "misses": 0},
        "aot_autograd_cache": {"hit": 1, "miss": 0, "bypass": 0},
        "trace_cache": {"hit": 1, "miss": 0, "error": 0},
    },
    "img_per_s": 8900.0,
}
REPORT = {"parts_s": {"inductor codegen": 20.0}, "fx_graph_cache": {"hits": 0, "misses": 2}}


def run_main(monkeypatch, tmp_path, *argv) -> list[tuple[str, list[str]]]:
    """bench/startup.py's main with ``argv``, its runs recorded instead of started."""
    calls = []

    def run(cmd, cache, log):
        calls.append((log.stem, cmd))
        return SUMMARY

    def run_compile(cmd, cache, log):
        calls.append((log.stem, cmd))
        return {**REPORT, "wall_s": 30.0}

    monkeypatch.setattr(startup, "run", run)
    monkeypatch.setattr(startup, "run_compile", run_compile)
    monkeypatch.setattr(sys, "argv", ["startup.py", "--out", str(tmp_path), *argv])
    startup.main()
    return calls


def test_every_start_by_default(monkeypatch, tmp_path):
    calls = run_main(monkeypatch, tmp_path, "--variant", "t=--compile-mode auto")
    assert [c[0] for c in calls] == [
        "t-cold",
        "t-warm",
        "t-resumed",
        "t-compile",
        "t-after-compile",
    ]
    assert all("--compile-mode" in cmd for _, cmd in calls)
    table = (tmp_path / "startup.md").read_text()
    assert "| t | warm | 12.5 | imports 8.0, model 3.0, first step 1.5 |" in table
    assert "FX 2/2, AOT 1/1, trace 1/1 | 8,900 |" in table
    assert "| t | compile (to its exit) | 30.0 | inductor codegen 20.0 | FX 0/2 |" in table


def test_only_the_starts_named(monkeypatch, tmp_path):
    calls = run_main(monkeypatch, tmp_path, "--starts", "compile", "--variant", "t=")
    assert [c[0] for c in calls] == ["t-compile", "t-after-compile"]
    calls = run_main(monkeypatch, tmp_path, "--starts", "cold,warm", "--variant", "t=")
    assert [c[0] for c in calls] == ["t-cold", "t-warm"]


@pytest.mark.parametrize(
    "starts, says",
    [("warm", "warm follows cold"), ("cold,resumed", "resumed follows warm"), ("hot", "choose")],
)
def test_starts_out_of_order_or_unknown_stop(monkeypatch, tmp_path, capsys, starts, says):
    with pytest.raises(SystemExit) as stop:
        run_main(monkeypatch, tmp_path, "--starts", starts)
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_a_row_names_the_step_that_tuned_later():
    summary = {
        "startup": {"total_s": 61.0, "parts_s": {"inductor codegen": 25.0},
                    "fx_graph_cache": {"hits": 0, "misses": 2}},
        "img_per_s": 9000.0,
        "late_tuning": {"step": 212, "kernels": 127, "seconds": 41.5},
    }  # fmt: skip
    line = startup.row("later", "cold", summary)
    assert "| 61.0 |" in line and "tuned later: 127 kernels, step 212, 41.5" in line
    summary["late_tuning"] = {"step": None, "kernels": 127}
    assert "tuned later: 127 kernels, not before the run's end" in startup.row("l", "cold", summary)


def test_a_failed_run_is_a_row(monkeypatch):
    assert "failed (exit 1)" in startup.row("t", "cold", {"exit": 1})
    assert "failed (exit 2)" in startup.compile_row("t", {"exit": 2})
