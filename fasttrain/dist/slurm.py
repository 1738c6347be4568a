"""An ``srun`` launch without torchrun: SLURM's variables as the ones torchrun sets.

``srun`` starts every task itself and says who each is in ``SLURM_PROCID`` (the global rank),
``SLURM_LOCALID`` (the rank on its node), ``SLURM_NTASKS`` (the world size) and the job's nodes
in ``SLURM_JOB_NODELIST`` (compressed, e.g. ``gpu[01-04]``, which ``scontrol show hostnames``
expands). As timm and torchvision's references do, the first node hosts the rendezvous
(``MASTER_ADDR``); the port is ``MASTER_PORT`` if set, else derived from the job id so that two
jobs sharing a node do not collide.

Only a task that srun started (``SLURM_STEP_ID`` set) is mapped, and only when torchrun's
variables are absent: an ``salloc`` shell also carries ``SLURM_NTASKS``, and a process there
must not wait for ranks that will never start. ``srun ... torchrun ...`` keeps torchrun's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping

from fasttrain.errors import UserError

PORT_BASE, PORT_SPAN = 15000, 20000


def scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``: the node names, in order."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        if re.fullmatch(r"[\w.-]+(,[\w.-]+)*", nodelist):  # plain names need no expanding
            return nodelist.split(",")
        raise UserError(
            f"SLURM_JOB_NODELIST={nodelist}: scontrol is not on PATH to expand it; set "
            "MASTER_ADDR to the first node's address"
        )
    out = subprocess.run(
        [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
    )
    names = out.stdout.split()
    if out.returncode != 0 or not names:
        raise UserError(
            f"scontrol show hostnames {nodelist} failed ({out.stderr.strip()[:200]}); set "
            "MASTER_ADDR to the first node's address"
        )
    return names


def _tasks_per_node(value: str) -> int:
    """SLURM writes tasks per node as ``4``, ``4(x2)`` or ``4(x2),3``: the first count."""
    match = re.match(r"\d+", value)
    return int(match.group()) if match else 1


def torchrun_env(
    env: Mapping[str, str], hostnames: Callable[[str], list[str]] = scontrol_hostnames
) -> dict[str, str]:
    """The variables torchrun would set, from an srun task's SLURM variables (module notes);
    empty when this is not such a task or torchrun's are already there."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return {}
    if "SLURM_PROCID" not in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return {}
    world = env.get("SLURM_NTASKS", "1")
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": world,
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(
            _tasks_per_node(
                env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", world)
            )
        ),
    }
    if int(world) > 1:
        if "MASTER_ADDR" not in env:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise UserError(
                    "an srun task without SLURM_JOB_NODELIST: set MASTER_ADDR to the first "
                    "node's address"
                )
            out["MASTER_ADDR"] = hostnames(nodelist)[0]
        if "MASTER_PORT" not in env:
            job = int(env.get("SLURM_JOB_ID", "0") or 0)
            out["MASTER_PORT"] = str(PORT_BASE + job % PORT_SPAN)
    return out
