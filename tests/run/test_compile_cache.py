"""Compiled code kept for the next start (``run/compile_cache.py``), on the CPU: a run's own
artifacts make a resume on a "new machine" (an empty cache directory) start warm, a changed
setting has another key and never loads another's trace, and two processes of the next job both
find the first job's cache, or what ``fasttrain compile`` compiled in one process for them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST

COMPILE = [*FAST, "--compile", "--eval-every", "0", "--log-every", "1"]
HANG_S = 600  # each run here takes a minute or two on two cores


def fasttrain(*argv, env: dict | None = None) -> subprocess.CompletedProcess:
    """A run in a process of its own: torch keeps compiled code in memory too. One that hangs
    is stopped with SIGABRT, which Python's fault handler answers with every thread's stack in
    each of its processes, so that the failure says where it hung."""
    args = [sys.executable, "-m", "fasttrain", *map(str, argv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    ) as run:  # fmt: skip
        try:
            out, err = run.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGABRT)
            try:
                out, err = run.communicate(timeout=30)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.pid, signal.SIGKILL)
            pytest.fail(f"fasttrain {argv} still running after {HANG_S} s; stacks:\n{err[-20000:]}")
    assert run.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(args, run.returncode, out, err)


def warm(run_dir: Path, rank: int = 0) -> tuple[bool, int, int]:
    """(dynamo's trace loaded, FX graph cache hits, misses) at the first step of the folder's
    latest run, from the rank's log (a resumed run appends to it)."""
    lines = (run_dir / f"log-rank{rank}.txt").read_text().splitlines()
    line = [x for x in lines if "start-up" in x][-1]
    loaded = "dynamo's trace loaded from the cache" in line
    if "FX graph cache: " not in line:  # nothing compiled
        return loaded, 0, 0
    hits, misses = line.split("FX graph cache: ")[1].split(" misses")[0].split(" hits, ")
    return loaded, int(hits), int(misses)


@pytest.fixture(scope="module")
def first_run(tiny_data, tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, cache directory) of a cold compiled run, shared by the tests below: a cold
    compile is most of a minute on the CPU."""
    where = tmp_path_factory.mktemp("first")
    out, cache = where / "run", where / "machine-a"
    fasttrain("--data", tiny_data, *COMPILE, "--max-steps", "2", "--output-dir", out,
              "--compile-cache", cache)  # fmt: skip
    return out, cache


@pytest.mark.slow
def test_a_resume_on_a_new_machine_starts_warm_from_the_runs_artifacts(
    tiny_data, first_run, tmp_path
):
    out, machine_a = first_run
    saved = list((out / "compile-cache").glob("*.bin"))
    assert len(saved) == 1 and saved[0].stat().st_size > 0
    assert machine_a.is_dir() and any(machine_a.iterdir())
    loaded, _, misses = warm(out)
    assert not loaded and misses > 0  # it traced and compiled
    summary = json.loads((out / "summary.json").read_text())
    parts = summary["startup"]["parts_s"]
    assert parts["dynamo trace"] > 0 and parts["AOT autograd"] > 0
    assert parts["imports, flags and the process group"] > 0 and "model and optimizer" in parts
    assert sum(parts.values()) == pytest.approx(summary["startup"]["total_s"], abs=0.05)

    # a second run on that machine starts from dynamo's trace, compiling nothing; it still
    # keeps the artifacts the first run recorded
    warm_run = tmp_path / "warm-run"
    fasttrain("--data", tiny_data, *COMPILE, "--max-steps", "2", "--output-dir", warm_run,
              "--compile-cache", machine_a)  # fmt: skip
    assert warm(warm_run) == (True, 0, 0)

    # each folder resumed with an empty cache directory: its artifacts fill it
    for folder, machine in ((out, "machine-b"), (warm_run, "machine-c")):
        fasttrain("--data", tiny_data, *COMPILE, "--max-steps", "4", "--output-dir", folder,
                  "--resume", "auto", "--compile-cache", tmp_path / machine)  # fmt: skip
        log = (folder / "log-rank0.txt").read_text()
        assert "compile cache entries from" in log and "this folder's earlier run" in log
        # dynamo's trace loaded: nothing traced, nothing compiled
        assert warm(folder) == (True, 0, 0), folder


@pytest.mark.slow
def test_a_warm_start_with_evaluation_loads_the_step_s_trace_and_evaluates(tiny_data, tmp_path):
    """Evaluation is compiled without dynamo's saved trace (step/inductor_setup.py): a warm
    start loads the step's trace alone, and its evaluation traces afresh."""
    flags = ["--data", tiny_data, *FAST, "--compile", "--eval-every", "1", "--log-every", "1",
             "--max-steps", "2", "--compile-cache", tmp_path / "cache"]  # fmt: skip
    fasttrain(*flags, "--output-dir", tmp_path / "cold")
    fasttrain(*flags, "--output-dir", tmp_path / "warm")
    log = (tmp_path / "warm" / "log-rank0.txt").read_text()
    line = [x for x in log.splitlines() if "start-up" in x][-1]
    assert "dynamo's trace loaded from the cache (1)" in line, line
    summary = json.loads((tmp_path / "warm" / "summary.json").read_text())
    assert summary["val"]["images"] > 0 and "could not be loaded" not in log


def test_the_key_changes_with_what_shapes_the_compiled_step():
    """Another batch, model, precision, compile mode or world size is another compiled step: a
    file of its own, so a changed run misses cleanly; what the step does not see (the LR, the
    epochs) keeps the key."""
    from fasttrain.config.cli import parse_args
    from fasttrain.run.compile_cache import key

    def of(*flags: str, world: int = 1) -> str:
        return key(
            parse_args(["--data", "/d", "--compile", *flags], cuda_available=False)[0], world
        )

    base = of()
    changed = [
        of("--batch-size", "128"),
        of("--arch", "resnet18"),
        of("--amp", "bf16"),
        of("--compile-mode", "max-autotune-no-cudagraphs"),
        of("--image-size", "160"),
        of("--label-smoothing", "0.1"),
        of("--loader", "synthetic"),
        of("--val-crop-size", "192"),
        of(world=2),
        of("--bucket-cap-mb", "25", world=2),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    assert of("--lr", "0.4", "--epochs", "3") == base
    assert of(world=8) == of(world=2)  # DDP's graphs, whatever the number of ranks


@pytest.mark.slow
@pytest.mark.dist
def test_one_compile_in_one_process_serves_every_process_of_a_job(tiny_data, tmp_path):
    """``fasttrain compile`` for a job of three processes compiles in one; a job of two on the
    same flags (DDP's graphs do not depend on the number) finds every graph in the cache on
    both ranks, the first step's and evaluation's, and compiles nothing."""
    cache = tmp_path / "shared"
    flags = ["--data", tiny_data, *FAST, "--compile", "--log-every", "1", "--batch-size", "8",
             "--eval-every", "1", "--compile-cache", cache]  # fmt: skip
    done = fasttrain("compile", "--nproc-per-node", "3", *flags, "--json")
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["evaluation"] and report["shapes"] == [{"epoch": 0, "batch": 8, "size": 32}]
    assert report["fx_graph_cache"]["misses"] > 0 and Path(report["cache"]).parent == cache
    assert "compiled for 3 processes" in done.stderr
    job = tmp_path / "job"
    fasttrain("--nproc-per-node", "2", *flags, "--max-steps", "2", "--output-dir", job)
    for rank in (0, 1):  # no trace is kept under DDP (compile_cache's notes)
        loaded, hits, misses = warm(job, rank)
        assert not loaded and hits > 0 and misses == 0, (rank, hits, misses)
    summary = json.loads((job / "summary.json").read_text())
    assert summary["val"]["images"] > 0  # it evaluated at its end
    assert summary["fx_graph_cache"] == {"hits": hits + 1, "misses": 0}  # evaluation's graph


@pytest.mark.slow
def test_compile_for_one_process_leaves_dynamo_s_trace_for_the_run(tiny_data, tmp_path):
    """One process keeps dynamo's trace: ``fasttrain compile`` saves it with the key's
    artifacts, and the run loads it, tracing and compiling nothing."""
    flags = ["--data", tiny_data, *COMPILE, "--compile-cache", tmp_path / "cache"]
    done = fasttrain("compile", *flags, "--json")
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["fx_graph_cache"]["misses"] > 0 and "compiled for one process" in done.stderr
    assert (Path(report["cache"]) / "artifacts.bin").is_file()
    fasttrain(*flags, "--max-steps", "2", "--output-dir", tmp_path / "run")
    assert warm(tmp_path / "run") == (True, 0, 0)


def test_compile_refuses_what_it_cannot_do_in_one_line(tmp_path, monkeypatch, capsys):
    from fasttrain.__main__ import main

    base = [
        "compile",
        "--loader",
        "synthetic",
        *FAST,
        "--compile",
        "--compile-cache",
        str(tmp_path),
    ]
    for argv, env, said in [
        (base, {"WORLD_SIZE": "2"}, "start it once, not through torchrun or srun"),
        ([*base, "--nproc-per-node", "0"], {}, "--nproc-per-node '0': expected a positive"),
        ([*base, "--nnodes", "x"], {}, "--nnodes 'x': expected a positive whole number"),
        ([a for a in base if a != "--compile"], {}, "train without --compile"),
        ([*base, "--sync-bn", "--nproc-per-node", "2"], {}, "--sync-bn all-reduces"),
    ]:
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert main(["compile", "--help"]) == 0
    assert "--nproc-per-node N" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing compiled, nothing written


@pytest.mark.slow
def test_a_trace_is_loaded_only_for_the_settings_it_was_traced_with(tiny_data, first_run, tmp_path):
    """Another setting in the first run's --compile-cache traces and compiles afresh (loading
    that run's trace would fail its guards, which torch cannot recover from); the first run's
    settings with --no-trace-cache trace again and hit inductor's cache."""
    cache = ["--compile-cache", first_run[1], "--max-steps", "2"]
    fasttrain("--data", tiny_data, *COMPILE, *cache, "--output-dir", tmp_path / "b",
              "--label-smoothing", "0.3")  # fmt: skip
    loaded, _, misses = warm(tmp_path / "b")
    assert not loaded and misses > 0
    fasttrain("--data", tiny_data, *COMPILE, *cache, "--output-dir", tmp_path / "c",
              "--no-trace-cache")  # fmt: skip
    loaded, hits, misses = warm(tmp_path / "c")
    assert not loaded and hits > 0 and misses == 0
    parts = json.loads((tmp_path / "c" / "summary.json").read_text())["startup"]["parts_s"]
    assert parts["dynamo trace"] > 0


def test_the_trace_cache_is_kept_only_where_the_steps_shapes_are_fixed():
    from fasttrain.config.cli import parse_args
    from fasttrain.run.compile_cache import trace_cache_applies

    def applies(*flags: str, world: int = 1) -> bool:
        cfg = parse_args(["--data", "/d", "--compile", *flags], cuda_available=False)[0]
        return trace_cache_applies(cfg, world)

    assert applies()
    assert not applies(world=2)
    assert not applies("--no-trace-cache")
    assert not applies("--batch-size", "auto")
    assert not applies("--progressive-resizing", "160:192:0:2")


def test_a_start_that_loaded_the_folder_s_artifacts_replaces_them_only_with_more(
    tmp_path, monkeypatch
):
    """A start from the folder's artifacts records less than it loaded (torch records what it
    compiles and some of what it loads, not the tuned kernels' results). Written over the
    folder's file, that left the next resume on a new machine to compile and tune again. The
    key's file on the new machine starts with what was loaded, for the runs that copy it."""
    import torch

    from fasttrain.config.cli import parse_args
    from fasttrain.run import compile_cache

    cfg = parse_args(
        ["--data", "/d", "--compile", "--compile-cache", str(tmp_path / "new-machine")],
        cuda_available=False,
    )[0]
    artifacts = compile_cache.Artifacts(tmp_path / "run", cfg, 1, is_main=True)
    assert artifacts.path is not None
    artifacts.path.parent.mkdir(parents=True)
    artifacts.path.write_bytes(b"the first run's" * 10)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: None)
    assert artifacts.load()
    # the new machine's file for the key, which a run that starts from the trace copies
    assert artifacts.shared is not None
    assert artifacts.shared.read_bytes() == b"the first run's" * 10

    totals = {"inductor": 0.0}
    monkeypatch.setattr(compile_cache, "compile_totals", lambda: dict(totals))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"less", None))
    artifacts.save()  # after the first step
    assert artifacts.path.read_bytes() == b"the first run's" * 10
    assert artifacts.shared.read_bytes() == b"the first run's" * 10

    totals["inductor"] = 1.0  # evaluation compiled: more than the file held
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"more" * 100, None))
    artifacts.save()
    assert artifacts.path.read_bytes() == b"more" * 100
