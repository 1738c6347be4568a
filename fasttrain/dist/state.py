"""Distributed state in one object, read from torchrun's environment, an srun task's
(``slurm.py``), or a single process.

Code below asks ``DistState`` questions (rank, device, is_main) and calls its collectives, which are
no-ops in a single process; nothing else reads the environment or touches the process group.
torchrun (``--standalone`` or multi-node ``--rdzv-backend c10d``) sets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the process group starts from those (``env://``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from fasttrain.errors import RuntimeFault, UserError, first_line

HW_QUEUES_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
HW_QUEUES = "32"  # the most the driver allows


def claim_hardware_queues() -> str:
    """Give CUDA streams their own hardware queues: ``CUDA_DEVICE_MAX_CONNECTIONS=32`` unless the
    user set it; returns the value in force. Must run before CUDA initialises.

    With the driver's default of 8 queues, some of DALI's decoder streams share one with the
    training stream, so their small per-image kernels wait behind the whole CUDA-graph replay:
    on an H200 DALI cost 15% end to end against synthetic data with 8 queues and 2.8% with 32
    (BENCHMARKS.md, docs/DESIGN.md). Torch's own work is unaffected (synthetic: within 1%).
    """
    return os.environ.setdefault(HW_QUEUES_ENV, HW_QUEUES)


class CollectiveTimeout(RuntimeFault):
    """A collective waited past ``--dist-timeout``: a runtime fault, not a bad flag (exit 1)."""


@dataclass(frozen=True)
class DistState:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def one_node(self) -> bool:
        """Every rank on this host: the all-reduce runs over NVLink/PCIe, not the network."""
        return self.local_world_size >= self.world_size

    @classmethod
    def from_env(cls, device_type: str = "auto", timeout_s: int = 600) -> DistState:
        """Build from RANK / LOCAL_RANK / WORLD_SIZE (set by torchrun, or mapped from an srun
        task's SLURM variables); defaults: one process.
        ``device_type`` is ``--device``: auto, cuda or cpu.

        With several processes, start the process group: NCCL on GPUs, gloo on the CPU. A
        collective that waits longer than ``timeout_s`` fails with an error naming the rank and
        the collective instead of hanging.
        """
        from fasttrain.dist.slurm import torchrun_env

        os.environ.update(torchrun_env(os.environ))  # an srun task: SLURM's variables
        if device_type == "auto":
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        elif device_type == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA GPU is visible; use --device cpu or auto")
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        except ValueError as e:
            raise UserError(
                f"WORLD_SIZE / RANK / LOCAL_RANK / LOCAL_WORLD_SIZE must be integers ({e})"
            ) from None
        if device_type == "cuda":
            count = torch.cuda.device_count()
            # several ranks per host each see their own GPU only, as cuda:0 (dist/devices.py)
            index = 0 if count == 1 else local_rank
            if index >= count:
                raise UserError(
                    f"LOCAL_RANK={local_rank} but only {count} GPU(s) are "
                    "visible: start at most one process per GPU (--nproc-per-node)"
                )
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        else:
            device = torch.device("cpu")
        if world > 1 and not tdist.is_initialized():
            if "MASTER_ADDR" not in os.environ:
                raise UserError(
                    f"WORLD_SIZE={world} without MASTER_ADDR: launch with torchrun or "
                    "python -m fasttrain --nproc-per-node N"
                )
            tdist.init_process_group(
                "nccl" if device_type == "cuda" else "gloo",
                timeout=timedelta(seconds=timeout_s),
                device_id=device if device_type == "cuda" else None,
            )
        return cls(rank, local_rank, world, device, local_world)

    # ---- collectives: no-ops in one process ------------------------------------------------
    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Turn a timed-out collective into one line naming this rank and ``what`` waited.

        gloo's own message names neither; NCCL's watchdog names both in its own log line
        ("[Rank N] Watchdog caught collective operation timeout: WorkNCCL(... OpType=...)")."""
        try:
            yield
        except (RuntimeError, tdist.DistError) as e:
            text = str(e)
            if not self.distributed or not any(
                k in text for k in ("Timed out", "timed out", "Timeout", "timeout", "Watchdog")
            ):
                raise
            reason = first_line(text, text.strip())[:200]
            raise CollectiveTimeout(
                f"rank {self.rank}: {what} waited longer than --dist-timeout for the other "
                f"ranks ({reason}); one of them is hung or has died: see its log-rank<N>.txt"
            ) from None

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum", what: str = "an all_reduce"):
        """Sum (or average, ``op="mean"``) ``tensor`` over ranks, in place."""
        if self.distributed:
            with self.collective(what):
                tdist.all_reduce(tensor, tdist.ReduceOp.SUM)
            if op == "mean":
                tensor /= self.world_size
        return tensor

    def all_gather_object(self, obj: Any, what: str = "an all_gather") -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.collective(what):
            tdist.all_gather_object(out, obj)
        return out

    def barrier(self, what: str = "a barrier") -> None:
        if self.distributed:
            with self.collective(what):
                tdist.barrier()

    def close(self) -> None:
        """Destroy the process group, after freeing what is only unreachable: DDP's reducer sits
        in reference cycles, and with a comm hook its pending futures hold Python callbacks;
        left to interpreter exit, gloo's threads free them without the GIL and the process
        aborts (pytorch/pytorch PR 179291)."""
        if self.distributed and tdist.is_initialized():
            gc.collect()
            tdist.destroy_process_group()
