"""Convergence, path against path: the same recipe trained on the fused BatchNorm path (fp16) and
the plain one (bf16) from several seeds, on the built-in sample set or the harder one
(``sample.HARD``: 100 classes with clutter) or a folder of your own. Writes each run's folder, a
markdown table (stdout and ``OUT/convergence.md``), every run's curves as JSON
(``OUT/curves.json``) and a plot of the train loss and val top-1 (``OUT/convergence.png``, needs
matplotlib: the ``bench`` extra).

Each run is ``python -m fasttrain`` with the sample recipe, compiled and graphed, evaluated every
epoch, ``--fused-bn on`` (fp16) or ``--fused-bn off`` (bf16), ``--seed`` S; flags after
``--`` are added to every run. ``--concurrent K`` trains K runs at once on one GPU (their compiles
overlap; accuracy is what this tool measures, so their img/s is not reported).

Examples:
    python bench/convergence.py                                   # 3 seeds each, sample set
    python bench/convergence.py --set hard -- --epochs 12         # the harder set
    python bench/convergence.py --paths fused --seeds 0 -- --epochs 60   # one long fused run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# --amp auto follows the path: fp16 on the fused one, bf16 on the plain one (off on the CPU)
PATHS = {"fused": ["--fused-bn", "on"], "plain": ["--fused-bn", "off"]}
FLAGS = ["--config", str(REPO / "configs" / "sample.yaml"), "--compile", "--cuda-graphs",
         "--eval-every", "1", "--log-every", "10"]  # fmt: skip
LAST = 3  # the epochs whose val top-1 is averaged (the end of a run wanders by a point or two)


def data_set(name: str) -> Path:
    """The sample set, the harder one, or a folder."""
    from fasttrain.config.paths import cache_dir
    from fasttrain.data.sample import HARD, SampleSpec, build_sample

    if name in ("sample", "hard"):
        return build_sample(cache_dir(), HARD if name == "hard" else SampleSpec())
    return Path(name).resolve()


def curves(run: Path) -> dict:
    """A run's train loss by step, val top-1 by epoch, and fp16's loss scale and skipped
    updates, from its metrics.jsonl; its summary."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    summary = run / "summary.json"
    return {
        "step": [r["step"] for r in train],
        "loss": [r["loss"] for r in train],
        "nonfinite": sum(r["nonfinite_losses"] for r in train),
        "loss_scale": [r.get("loss_scale") for r in train],
        "skipped": sum(r.get("skipped_steps") or 0 for r in train),
        "epoch": [r["epoch"] for r in val],
        "top1": [r["top1"] for r in val],
        "summary": json.loads(summary.read_text()) if summary.is_file() else None,
    }


def table(runs: dict[str, dict]) -> str:
    """One row per run, then the mean per path."""
    lines = [
        f"| run | final train loss | val top-1, last | val top-1, mean of last {LAST} | "
        "non-finite losses | skipped updates | loss scale (min-max) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    by_path: dict[str, list[float]] = {}
    for name, c in runs.items():
        if not c["top1"]:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        tail = statistics.fmean(c["top1"][-LAST:])
        by_path.setdefault(name.rsplit("-s", 1)[0], []).append(tail)
        scales = [s for s in c["loss_scale"] if s is not None]
        scale = f"{min(scales):,.0f}-{max(scales):,.0f}" if scales else "-"
        lines.append(
            f"| {name} | {c['loss'][-1]:.4f} | {c['top1'][-1]:.2f}% | {tail:.2f}% | "
            f"{c['nonfinite']} | {c['skipped']} | {scale} |"
        )
    for path, tails in by_path.items():
        spread = f"{min(tails):.2f}-{max(tails):.2f}%"
        lines.append(f"| **{path}**, {len(tails)} seeds | | | {spread} | | | |")
    return "\n".join(lines)


def plot(runs: dict[str, dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    long = any(s is not None for c in runs.values() for s in c["loss_scale"])
    fig, axes = plt.subplots(1, 3 if long else 2, figsize=(15 if long else 10, 3.6))
    colours = {"fused": "tab:red", "plain": "tab:blue"}
    for name, c in runs.items():
        colour = colours.get(name.split("-")[-2])
        axes[0].plot(c["step"], c["loss"], color=colour, alpha=0.6, lw=1, label=name)
        axes[1].plot(c["epoch"], c["top1"], color=colour, alpha=0.7, marker=".", label=name)
        if long:
            steps = [st for st, s in zip(c["step"], c["loss_scale"], strict=True) if s]
            axes[2].plot(steps, [s for s in c["loss_scale"] if s], color=colour, label=name)
    axes[0].set(title="train loss", xlabel="step")
    axes[1].set(title="val top-1 (%)", xlabel="epoch")
    if long:
        axes[2].set(title="fp16 loss scale", xlabel="step", yscale="log")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="flags after -- are "
                                "added to every run")  # fmt: skip
    p.add_argument("--set", default="sample", help="sample, hard, or an ImageFolder root")
    p.add_argument("--paths", default="fused,plain", help="comma list: fused, plain")
    p.add_argument("--seeds", default="0,1,2", help="comma list of --seed values")
    p.add_argument("--concurrent", type=int, default=1, help="runs trained at once on the GPU")
    p.add_argument("--out", type=Path, default=Path("convergence-runs"), help="output directory")
    args, extra = p.parse_known_args()
    data = data_set(args.set)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    label = Path(args.set).name if args.set not in ("sample", "hard") else args.set
    plan = [
        (f"{label}-{path}-s{seed}", [*FLAGS, "--data", str(data), *PATHS[path], "--seed", seed,
                                     *[f for f in extra if f != "--"]])
        for path, seed in itertools.product(args.paths.split(","), args.seeds.split(","))
    ]  # fmt: skip
    waiting, running = list(plan), []
    while waiting or running:
        while waiting and len(running) < args.concurrent:
            name, argv = waiting.pop(0)
            out = args.out / name
            cmd = [sys.executable, "-m", "fasttrain", *argv, "--output-dir", str(out)]
            log = open(out.with_suffix(".log"), "w")  # noqa: SIM115 (closed below)
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=args.out)  # fmt: skip
            running.append((name, proc, log, time.perf_counter()))
        for item in list(running):
            name, proc, log, t0 = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                print(f"{name}: exit {proc.returncode} after {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr)  # fmt: skip
        time.sleep(1)
    runs = {}
    for name, _ in plan:
        run = args.out / name
        runs[name] = curves(run) if (run / "metrics.jsonl").is_file() else {"top1": []}
    (args.out / "curves.json").write_text(json.dumps(runs) + "\n")
    text = table(runs)
    (args.out / "convergence.md").write_text(text + "\n")
    print(text)
    try:
        plot({k: v for k, v in runs.items() if v["top1"]}, args.out / "convergence.png")
    except ImportError:
        print("(no plot: pip install matplotlib)", file=sys.stderr)


if __name__ == "__main__":
    main()
