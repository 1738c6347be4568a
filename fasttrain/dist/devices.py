"""Each rank sees its own GPU only, as ``cuda:0``, so that every rank compiles the same code.

Inductor's FX graph cache key and the code it generates hold the device index: rank 3 compiling
for ``cuda:3`` never finds what rank 0 compiled for ``cuda:0``, in this job or the next
(pytorch/pytorch#175944). The maintainers' answer is to let each rank see its GPU as device 0
(torchrun's ``--virtual-local-rank``). fasttrain does it for every launcher (its own
``--nproc-per-node``, torchrun, an srun task), before CUDA starts: with several ranks on a host,
``CUDA_VISIBLE_DEVICES`` becomes the rank's own entry of the list it inherited (or its local
rank, where none was set). A list of one GPU (srun's ``--gpus-per-task 1``) is left as it is.
NCCL still finds the other GPUs of the host (by their bus ids) for its peer-to-peer links.
"""

from __future__ import annotations

from collections.abc import MutableMapping

VISIBLE = "CUDA_VISIBLE_DEVICES"


def one_gpu_per_rank(env: MutableMapping[str, str]) -> str | None:
    """Narrow ``CUDA_VISIBLE_DEVICES`` in ``env`` to this rank's GPU (module notes); returns the
    GPU kept, or None where nothing changed. Must run before CUDA initialises."""
    from fasttrain.dist.slurm import torchrun_env

    # only the local rank and count matter here: no rendezvous address is looked up
    placeholder = {"MASTER_ADDR": "-", "MASTER_PORT": "0"}
    launched = {**torchrun_env({**env, **placeholder}), **env}
    try:
        local_rank = int(launched.get("LOCAL_RANK", "0"))
        local_world = int(launched.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return None  # DistState says what is wrong with them
    if "LOCAL_RANK" not in launched or local_world < 2:
        return None
    given = env.get(VISIBLE)
    if given is None:
        mine = str(local_rank)
    else:
        entries = [e.strip() for e in given.split(",") if e.strip()]
        if len(entries) < 2 or local_rank >= len(entries):
            return None  # already one GPU, or too few for the ranks: DistState says so
        mine = entries[local_rank]
    env[VISIBLE] = mine
    return mine
