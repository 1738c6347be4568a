"""Distributed state in one object, read from torchrun's environment (or a single process).

Code below asks ``DistState`` questions (rank, device, is_main) and never reads the environment
itself. Multi-process training (DDP) is not built yet: a multi-process launch is refused with a
clear message rather than silently training N independent copies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fasttrain.errors import UserError


@dataclass(frozen=True)
class DistState:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_type: str) -> DistState:
        """Build from RANK / LOCAL_RANK / WORLD_SIZE (set by torchrun); defaults: one process."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        except ValueError as e:
            raise UserError(f"WORLD_SIZE / RANK / LOCAL_RANK must be integers ({e})") from None
        if world > 1:
            raise UserError(
                f"WORLD_SIZE={world}: multi-process training (torchrun, DDP) is not "
                "supported yet; run a single process"
            )
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        return cls(rank, local_rank, world, device)
