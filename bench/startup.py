"""The time to the first step, cold, warm and resumed on a "new machine", through the CLI: a
markdown table (stdout and ``OUT/startup.md``) of each run's parts, from its ``summary.json``
(``startup``), and every summary (``OUT/summaries.jsonl``).

Each variant runs three times in a row, each run a fresh process:
- **cold**: empty caches (a directory of its own for inductor, Triton and fasttrain's caches);
- **warm**: the same command again, its caches filled;
- **resumed, new machine**: the warm run's folder resumed (``--resume auto``) with empty caches
  again, CUDA's JIT cache included, so only what the run folder kept (its compile artifacts,
  Triton kernels and CUDA's JIT cache) is there; the cold and warm runs' caches are emptied
  first, as a new machine lacks them;
- **resumed again, new machine**: the same folder resumed once more on another such machine,
  from what the first resume left in it;
- **compile**: ``python -m fasttrain compile`` with the same flags into empty caches (its own
  time, start to exit), then **after compile**: the run in those caches.

Examples:
    python bench/startup.py                                # fused default, default and tuned
    python bench/startup.py --starts compile               # only the compile row and its run
    python bench/startup.py --variant plain="--fused-bn off"
    python bench/startup.py --starts cold --variant later="--tune-kernels later" -- \
        --loader synthetic --compile --cuda-graphs --max-steps 3000
    python bench/startup.py -- --loader dali --data /data/imagenet
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = ["--loader", "synthetic", "--compile", "--cuda-graphs", "--max-steps", "40"]
VARIANTS = {"default mode": "--compile-mode default", "tuned (auto)": "--compile-mode auto"}
TOP = 6  # parts named in the table, largest first
STARTS = ("cold", "warm", "resumed", "compile")


def cache_env(cache: Path, new_machine: bool = False) -> dict[str, str]:
    """This environment with fasttrain's caches, and so inductor's and Triton's, in ``cache``;
    ``new_machine``: CUDA's JIT cache there too (empty), as on a machine that never ran CUDA."""
    env = {**os.environ, "FASTTRAIN_CACHE": str(cache)}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)  # --compile-cache's default follows FASTTRAIN_CACHE
    if new_machine:
        env["CUDA_CACHE_PATH"] = str(cache / "cuda-jit")
        env.pop("CUDA_CACHE_DISABLE", None)
    return env


def gone(cache: Path) -> None:
    """Empty ``cache``, as a machine that never held it: paths into it that compiled code
    keeps (a loaded kernel's source, beside which inductor looks for its tuned config) find
    nothing, as on a new machine."""
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)


def largest(parts: dict[str, float]) -> str:
    """The ``TOP`` largest parts, in seconds, largest first."""
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:TOP]
    return ", ".join(f"{k} {v:.1f}" for k, v in top)


def run(argv: list[str], cache: Path, log: Path, new_machine: bool = False) -> dict:
    """One ``python -m fasttrain`` with its caches in ``cache`` (``cache_env``); its summary."""
    env = cache_env(cache, new_machine)
    with log.open("w") as f:
        done = subprocess.run([sys.executable, "-m", "fasttrain", *argv], stdout=f,
                              stderr=subprocess.STDOUT, env=env)  # fmt: skip
    out = Path(argv[argv.index("--output-dir") + 1])
    summary = out / "summary.json"
    if done.returncode != 0 or not summary.is_file():
        return {"exit": done.returncode}
    return json.loads(summary.read_text())


def run_compile(argv: list[str], cache: Path, log: Path) -> dict:
    """``python -m fasttrain compile`` of the run's flags with its caches in ``cache``: its
    report (``--json``) and its time from start to exit."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fasttrain", "compile", *argv, "--json"],
                          capture_output=True, text=True, env=cache_env(cache))  # fmt: skip
    log.write_text(done.stderr + done.stdout)
    if done.returncode != 0:
        return {"exit": done.returncode}
    return {**json.loads(done.stdout.splitlines()[-1]), "wall_s": time.perf_counter() - t0}


def compile_row(label: str, c: dict) -> str:
    if "wall_s" not in c:
        return f"| {label} | compile | failed (exit {c.get('exit')}) | | | |"
    named = largest(c["parts_s"])
    fx = c["fx_graph_cache"]
    caches = f"FX {fx['hits']}/{fx['hits'] + fx['misses']}"
    return f"| {label} | compile (to its exit) | {c['wall_s']:.1f} | {named} | {caches} | |"


def row(label: str, start: str, s: dict) -> str:
    if "startup" not in s:
        return f"| {label} | {start} | failed (exit {s.get('exit')}) | | | |"
    r = s["startup"]
    named = largest(r["parts_s"])
    fx, aot = r["fx_graph_cache"], r.get("aot_autograd_cache", {})
    traces = r.get("trace_cache", {})
    caches = f"FX {fx['hits']}/{fx['hits'] + fx['misses']}"
    if aot:
        caches += f", AOT {aot['hit']}/{aot['hit'] + aot['miss'] + aot['bypass']}"
    if traces:
        caches += f", trace {traces['hit']}/{sum(traces.values())}"
    kernels = r.get("triton_kernels", {})
    if sum(kernels.values()):  # loaded compiled (used) / compiled / coordinate descent's runs
        caches += (
            f", kernels {kernels['loaded']} loaded ({kernels.get('used', 0)} used), "
            f"{kernels['compiled']} compiled, "
            f"{kernels['tuning_benchmarks']} tuning runs"
        )
    rate = f"{s['img_per_s']:,.0f}" if s.get("img_per_s") else ""
    if "late_tuning" in s:  # --tune-kernels later: the step that tuned
        late = s["late_tuning"]
        named += (
            f"; tuned later: {late['kernels']} kernels, step {late['step']}, {late['seconds']:.1f}"
            if late["step"] is not None
            else f"; tuned later: {late['kernels']} kernels, not before the run's end"
        )
    return f"| {label} | {start} | {r['total_s']:.1f} | {named} | {caches} | {rate} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/startup"))
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="runs with FLAGS added (default: the default and tuned compile modes)",
    )
    p.add_argument(
        "--starts",
        default="cold,warm,resumed,compile",
        help="which starts to run, comma-separated (default: %(default)s): warm follows cold, "
        "resumed follows warm, and compile brings the run after it",
    )
    p.add_argument(
        "flags",
        nargs="*",
        help="after --: the trainer's flags (default: synthetic data, compiled, graphed, 40 steps)",
    )
    args = p.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant) or VARIANTS
    chosen = set(filter(None, args.starts.split(",")))
    if not chosen or chosen - set(STARTS):
        p.error(f"--starts {args.starts}: choose from {','.join(STARTS)}")
    for start, before in (("warm", "cold"), ("resumed", "warm")):
        if start in chosen and before not in chosen:
            p.error(f"--starts {args.starts}: {start} follows {before}; add {before}")
    flags = args.flags or FLAGS
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "| variant | start | first step after (s) | largest parts (s) | cache hits | img/s |",
        "|---|---|---:|---|---|---:|",
    ]
    with (args.out / "summaries.jsonl").open("w") as jsonl:
        for label, extra in variants.items():
            slug = "".join(c if c.isalnum() else "-" for c in label)
            folders = [args.out / f"{slug}-{x}" for x in ("cold", "warm")]
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
            cold, warm = ([*flags, *extra.split(), "--output-dir", str(f)] for f in folders)
            with (
                tempfile.TemporaryDirectory() as a,
                tempfile.TemporaryDirectory() as b,
                tempfile.TemporaryDirectory() as c,
            ):
                resume = [*warm, "--resume", "auto", "--max-steps"]
                starts = [  # (--starts name, log name, row, command, caches, a new machine)
                    ("cold", "cold", "cold", cold, Path(a), False),
                    ("warm", "warm", "warm", warm, Path(a), False),
                    # the warm run's folder, its checkpoint and compile artifacts, elsewhere
                    ("resumed", "resumed", "resumed, new machine", [*resume, "60"], Path(b),
                     True),
                    ("resumed", "resumed-again", "resumed again, new machine",
                     [*resume, "80"], Path(c), True),
                ]  # fmt: skip
                for name, log, start, cmd, cache, new_machine in starts:
                    if name not in chosen:
                        continue
                    if new_machine:
                        gone(Path(a))  # a new machine lacks the cold and warm runs' caches too
                    s = run(cmd, cache, args.out / f"{slug}-{log}.log", new_machine)
                    jsonl.write(json.dumps({"variant": label, "start": start, **s}) + "\n")
                    lines.append(row(label, start, s))
                    print(lines[-1], flush=True)
            if "compile" not in chosen:
                continue
            with tempfile.TemporaryDirectory() as c:
                ahead = args.out / f"{slug}-ahead"
                shutil.rmtree(ahead, ignore_errors=True)
                compiled = run_compile([*flags, *extra.split()], Path(c),
                                       args.out / f"{slug}-compile.log")  # fmt: skip
                jsonl.write(json.dumps({"variant": label, "start": "compile", **compiled}) + "\n")
                lines.append(compile_row(label, compiled))
                print(lines[-1], flush=True)
                s = run([*flags, *extra.split(), "--output-dir", str(ahead)], Path(c),
                        args.out / f"{slug}-after-compile.log")  # fmt: skip
                jsonl.write(json.dumps({"variant": label, "start": "after compile", **s}) + "\n")
                lines.append(row(label, "after compile", s))
                print(lines[-1], flush=True)
    table = "\n".join(lines)
    (args.out / "startup.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
