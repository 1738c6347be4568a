"""End to end through the CLI, side by side: synthetic data against DALI from JPEG files, and one
GPU against N, on whatever machine this runs. Writes a markdown table (stdout and
``OUT/e2e.md``) and every run's summary (``OUT/summaries.jsonl``).

Each run is ``python -m fasttrain`` with the same flags (default: the sample recipe, compiled and
graphed, 8 epochs, no evaluation); its figure is the trainer's steady img/s per GPU (every log
interval after the first epoch). Synthetic runs take as many steps per epoch as the JPEG set
gives, so both train the same steps. Runs are interleaved, repeat by repeat, so that a drift of
the machine does not fall on one variant.

``--tree LABEL=PATH`` adds another version of fasttrain, run the same way beside this one: PATH
is a directory that ``import fasttrain`` finds it in, first on PYTHONPATH (e.g. another commit
installed with ``pip install --no-deps --target PATH CHECKOUT``). ``--variant LABEL=FLAGS`` adds
runs with FLAGS appended to the trainer's flags, beside the runs without them (e.g.
``--variant fused="--fused-bn"``); ``--variants-only`` leaves the runs without them out.

Examples:
    python bench/e2e.py                                # DALI against synthetic data, one GPU
    python bench/e2e.py --gpus 1,8 --repeat 3          # and scaling to 8 GPUs
    python bench/e2e.py --data /data/imagenet -- --max-steps 3000
    python bench/e2e.py --tree before=/tmp/before   # this version against another
    python bench/e2e.py --loaders dali --variant fused="--fused-bn"   # a flag's worth
    python bench/e2e.py --tree before=/tmp/before --variants-only \
        --variant plain=--no-fused-bn --variant fused=--fused-bn   # two versions, path by path
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
DEFAULT_FLAGS = ["--config", str(REPO / "configs" / "sample.yaml"), "--compile", "--cuda-graphs",
                 "--epochs", "8", "--eval-every", "0"]  # fmt: skip


def sample_set(per_class: int) -> tuple[Path, int]:
    """The built-in sample set with ``per_class`` train images per class (built once, cached)."""
    from fasttrain.config.paths import cache_dir
    from fasttrain.data.sample import SampleSpec, build_sample

    spec = SampleSpec(train_per_class=per_class)
    return build_sample(cache_dir(), spec), spec.classes * per_class


def environment(tree: Path | None) -> dict[str, str]:
    """The environment a run of ``tree`` (None: the installed fasttrain) starts in."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


def where(tree: Path | None, cwd: Path) -> str:
    """Where ``import fasttrain`` finds the package for ``tree``: what the runs will train with."""
    code = "import fasttrain; print(fasttrain.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=environment(tree), cwd=cwd,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip() or f"not importable: {out.stderr.strip().splitlines()[-1:]}"


PATH_FLAGS = ("--config", "--data", "--exclude-list", "--resume")


def absolute_paths(flags: list[str]) -> list[str]:
    """The trainer's flags with the paths they name made absolute: runs start in the output
    directory, where a path relative to the caller's directory would not be found."""
    out = list(flags)
    for i, flag in enumerate(out):
        name, eq, value = flag.partition("=")
        if name not in PATH_FLAGS:
            continue
        if eq and Path(value).exists():
            out[i] = f"{name}={Path(value).resolve()}"
        elif not eq and i + 1 < len(out) and Path(out[i + 1]).exists():
            out[i + 1] = str(Path(out[i + 1]).resolve())
    return out


def parse_variants(given: list[str], only: bool) -> list[tuple[str, list[str]]]:
    """(label, added flags) of each variant run: the flags as given (label "") unless ``only``,
    then each ``--variant LABEL=FLAGS``."""
    variants: list[tuple[str, list[str]]] = [] if only else [("", [])]
    return variants + [
        (v.split("=", 1)[0], absolute_paths(v.split("=", 1)[1].split())) for v in given
    ]


def run(label: str, tree: Path | None, argv: list[str], gpus: int, out: Path) -> dict:
    """One trainer run on ``gpus`` GPUs; its summary.json, with what ran. It starts outside the
    repository, so that ``python -m`` imports the installed package (or ``tree``), not the
    checkout's ./fasttrain."""
    launch = ["--nproc-per-node", str(gpus)] if gpus > 1 else []
    cmd = [sys.executable, "-m", "fasttrain", *launch, *argv, "--output-dir", str(out)]
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        code = subprocess.call(
            cmd, env=environment(tree), stdout=log, stderr=subprocess.STDOUT, cwd=out.parent
        )
    summary = {"run": out.name, "tree": label, "gpus": gpus, "exit": code, "cmd": " ".join(cmd)}
    summary["wall_s"] = time.perf_counter() - t0
    if code == 0 and (out / "summary.json").is_file():
        summary.update(json.loads((out / "summary.json").read_text()))
    return summary


def table(summaries: list[dict]) -> str:
    """Medians per (tree, loader, GPUs), against the same tree's synthetic and 1-GPU runs."""
    groups: dict[tuple, list[float]] = {}
    for s in summaries:
        rate = s.get("img_per_s_per_gpu")
        groups.setdefault((s["tree"], s["loader"], s["gpus"]), []).extend([rate] if rate else [])
    med = {k: statistics.median(v) for k, v in groups.items() if v}
    lines = [
        "| tree | loader | GPUs | img/s per GPU (median) | runs | vs synthetic | per-GPU scaling |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for (tree, loader, gpus), rates in groups.items():
        m = med.get((tree, loader, gpus))
        syn = med.get((tree, "synthetic", gpus))
        one = med.get((tree, loader, 1))
        runs = ", ".join(f"{r:,.0f}" for r in rates) or "failed"
        lines.append(
            f"| {tree} | {loader} | {gpus} | {f'{m:,.0f}' if m else '-'} | {runs} | "
            + (f"{100 * (m / syn - 1):+.1f}%" if m and syn and loader != "synthetic" else "")
            + " | "
            + (f"{100 * m / one:.1f}%" if m and one and gpus > 1 else "")
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="flags after -- "
                                "replace the trainer's default flags")  # fmt: skip
    p.add_argument("--data", type=Path, help="ImageFolder root (default: the sample set)")
    p.add_argument("--per-class", type=int, default=2000, help="sample set: train images per "
                   "class, of 10 classes (default 2000: 20,000 JPEGs)")  # fmt: skip
    p.add_argument("--loaders", default="synthetic,dali", help="comma list: synthetic, dali, "
                   "torchvision")  # fmt: skip
    p.add_argument("--gpus", default="1", help="comma list of GPU counts, e.g. 1,2,8")
    p.add_argument("--repeat", type=int, default=2, help="runs of each variant, interleaved")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                   help="another installed fasttrain to run beside this one")  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="also run with FLAGS (space-separated) added to the trainer's "
                   "flags")  # fmt: skip
    p.add_argument("--variants-only", action="store_true",
                   help="run the --variant runs alone, not the flags without them")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("e2e-runs"), help="output directory")
    args, extra = p.parse_known_args()
    flags = absolute_paths([f for f in extra if f != "--"] or DEFAULT_FLAGS)
    if args.data is not None:
        from fasttrain.data.folder import scan_folder

        data, images = args.data.resolve(), len(scan_folder(args.data).train)
    else:
        data, images = sample_set(args.per_class)
    trees: list[tuple[str, Path | None]] = [("this", None)]
    trees += [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree]
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    found = [f"{label}: {where(tree, args.out)}" for label, tree in trees]
    print("fasttrain imported from " + "; ".join(found), file=sys.stderr)
    variants = parse_variants(args.variant, args.variants_only)
    summaries = []
    runs = itertools.product(
        range(args.repeat), trees, variants, args.loaders.split(","), map(int, args.gpus.split(","))
    )  # interleaved: every variant once per repeat, so a drift of the machine is shared
    for r, (tree_label, tree), (variant, added), loader, gpus in runs:
        label = f"{tree_label} {variant}".strip()
        source = ["--data", str(data)]
        if loader == "synthetic":  # the same steps per epoch as the JPEG set
            batch = int(flags[flags.index("--batch-size") + 1]) if "--batch-size" in flags else 256
            source = ["--synthetic-steps", str(images // gpus // batch), "--num-classes", "10"]
        argv = [*flags, *added, "--loader", loader, *source]
        name = f"{label.replace(' ', '-')}-{loader}-{gpus}gpu-{r}"
        s = run(label, tree, argv, gpus, args.out / name)
        s["loader"] = loader
        summaries.append(s)
        rate = s.get("img_per_s_per_gpu")
        print(f"{name}: {f'{rate:,.0f} img/s per GPU' if rate else 'failed'}", file=sys.stderr)
        with open(args.out / "summaries.jsonl", "a") as f:
            f.write(json.dumps(s) + "\n")
    text = table(summaries) + "\n\nfasttrain imported from " + "; ".join(found)
    (args.out / "e2e.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
