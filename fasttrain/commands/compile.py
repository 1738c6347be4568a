"""``python -m fasttrain compile [--nproc-per-node N] [--nnodes M] FLAGS``: compile, in this
process, what each process of a job with FLAGS compiles, so that the job starts warm
(``run/precompile.py``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from fasttrain.commands import say
from fasttrain.commands.launch import take_count
from fasttrain.errors import UserError

USAGE = """usage: python -m fasttrain compile [--nproc-per-node N] [--nnodes M] [training flags]

Compile, in this one process, what every process of a training job with the same flags
compiles (the step at each train size, and evaluation), into the compile cache that job reads
(--compile-cache, else $FASTTRAIN_CACHE/compile, else ~/.cache/fasttrain/compile; inductor's
own where none is set and no trace is kept). Then the job's ranks, on every node that sees that
directory, start from the cache instead of each compiling for itself, and so do later jobs with
the same flags (the LR and the number of epochs may differ). Run it on the GPU model the job
runs on: the cache is keyed by it, and by torch's, Triton's and cuDNN's versions.

  --nproc-per-node N  the job's processes per node (default 1)
  --nnodes M          the job's nodes (default 1; DDP's buckets are smaller across nodes)
  training flags      the job's, as for python -m fasttrain (see its --help); --compile among
                      them. --max-steps and the output folder do not matter: nothing is trained
                      for keeps and no run folder is written.

Not for --sync-bn with several processes (its all-reduce is compiled into the step).
Prints one line, and with --json a JSON object: the cache key and directory, the shapes
compiled, the seconds and the FX graph cache's hits and misses.
"""


def main(argv: Sequence[str]) -> int:
    t_start = time.perf_counter()
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE, end="")
        return 0
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    nproc, argv = take_count(argv, "--nproc-per-node")
    nnodes, argv = take_count(argv, "--nnodes")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(
            "compile runs in one process and compiles for every rank of the job: start it once, "
            "not through torchrun or srun; --nproc-per-node N --nnodes M describe the job"
        )
    import torch

    from fasttrain.commands.train import use_sample_set
    from fasttrain.config.cli import parse_args
    from fasttrain.dist.state import DistState
    from fasttrain.metrics.startup import Startup
    from fasttrain.run.precompile import check, job_shape, precompile
    from fasttrain.run.resolve import resolve
    from fasttrain.run.runtime import setup_logging

    startup = Startup(t_start)
    cfg, notes = parse_args(argv, cuda_available=torch.cuda.is_available())
    here = DistState.from_env(cfg.train.device, cfg.train.dist_timeout)  # one process
    job = job_shape(nproc or 1, nnodes or 1, here.device)
    resolve(cfg, job, notes=notes)
    check(cfg, job)
    setup_logging(None, here)
    for note in notes:
        say(note)
    if cfg.data.path is None and cfg.data.loader != "synthetic":
        use_sample_set(cfg, here)
    done = precompile(cfg, job, startup)
    graphs = done["fx_graph_cache"]
    shapes = ", ".join(f"{s['batch']} x {s['size']} px" for s in done["shapes"])
    where = done["cache"] or "inductor's default cache directory (no --compile-cache given)"
    who = f"{job.world_size} processes" if job.distributed else "one process"
    say(
        f"compiled for {who} in {done['compile_s']:.1f} s (step at {shapes}"
        f"{', evaluation' if done['evaluation'] else ''}; inductor's FX graph cache "
        f"{graphs['hits']} hits, {graphs['misses']} misses) into {where}: a job with these "
        "flags starts from it"
    )
    if as_json:
        print(json.dumps(done))
    return 0
