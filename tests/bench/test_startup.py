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
        "triton_kernels": {"loaded": 127, "used": 127, "compiled": 0, "tuning_benchmarks": 0},
    },
    "img_per_s": 8900.0,
}
REPORT = {"parts_s": {"inductor codegen": 20.0}, "fx_graph_cache": {"hits": 0, "misses": 2}}
machines: list[tuple[str, Path, bool]] = []  # each run's (log name, caches, a new machine)


def run_main(monkeypatch, tmp_path, *argv) -> list[tuple[str, list[str]]]:
    """bench/startup.py's main with ``argv``, its runs recorded instead of started."""
    calls = []
    machines.clear()

    def run(cmd, cache, log, new_machine=False):
        calls.append((log.stem, cmd))
        machines.append((log.stem, cache, new_machine))
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
        "t-resumed-again",
        "t-compile",
        "t-after-compile",
    ]
    assert all("--compile-mode" in cmd for _, cmd in calls)
    # the resumes: the warm run's folder, each on a machine of its own with empty caches
    warm = calls[1][1]
    for _, cmd in calls[2:4]:
        assert cmd[: len(warm)] == warm and "--resume" in cmd
    (_, a, _), (_, a2, _), (_, b, new_b), (_, c, new_c) = machines[:4]
    assert a == a2 and len({a, b, c}) == 3 and new_b and new_c
    assert [m[2] for m in machines[:2]] == [False, False]
    table = (tmp_path / "startup.md").read_text()
    assert "| t | warm | 12.5 | imports 8.0, model 3.0, first step 1.5 |" in table
    assert "| t | resumed again, new machine | 12.5 |" in table
    caches = "FX 2/2, AOT 1/1, trace 1/1, kernels 127 loaded (127 used), 0 compiled, 0 tuning runs"
    assert f"{caches} | 8,900 |" in table
    assert "| t | compile (to its exit) | 30.0 | inductor codegen 20.0 | FX 0/2 |" in table


def test_the_resumes_find_none_of_the_warm_runs_caches(monkeypatch, tmp_path):
    """Inductor looks for a loaded kernel's tuned config where it was compiled: a resume while
    the cold run's caches still exist would find them there, as no new machine can."""
    seen = {}

    def run(cmd, cache, log, new_machine=False):
        if not new_machine:
            (cache / f"{log.stem}.entry").write_text("compiled")
            seen["warm caches"] = cache
        else:
            seen[log.stem] = sorted(p.name for p in seen["warm caches"].iterdir())
        return SUMMARY

    monkeypatch.setattr(startup, "run", run)
    monkeypatch.setattr(
        sys, "argv", ["startup.py", "--out", str(tmp_path), "--starts", "cold,warm,resumed",
                      "--variant", "t="],
    )  # fmt: skip
    startup.main()
    assert seen["t-resumed"] == [] and seen["t-resumed-again"] == []


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


def test_a_new_machine_has_a_cuda_jit_cache_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_CACHE_PATH", "/the/machines/own")
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "0")
    assert startup.cache_env(tmp_path)["CUDA_CACHE_PATH"] == "/the/machines/own"
    env = startup.cache_env(tmp_path, new_machine=True)
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "cuda-jit") and "CUDA_CACHE_DISABLE" not in env
    assert env["FASTTRAIN_CACHE"] == str(tmp_path)
