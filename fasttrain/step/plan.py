"""The run's epochs as optimizer steps: how many steps each epoch has, and at what global batch.

With one batch for the whole run (the usual case) every epoch has the same steps. Under
``--batch-size auto`` with ``--progressive-resizing``, each train size gets the largest batch
that fits it, so an epoch at a small size takes fewer, larger steps. The position in a run stays
the optimizer step; ``locate`` turns it into (epoch, step inside the epoch), which is what the
loop, the LR schedule and an exact resume derive everything else from.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class Plan:
    steps: tuple[int, ...]  # optimizer steps in each epoch
    global_batches: tuple[int, ...]  # images per optimizer step in each epoch, every process's

    @classmethod
    def uniform(cls, steps_per_epoch: int, global_batch: int, epochs: int) -> Plan:
        return cls((steps_per_epoch,) * epochs, (global_batch,) * epochs)

    def __post_init__(self) -> None:
        if len(self.steps) != len(self.global_batches) or not self.steps:
            raise ValueError(f"a plan needs steps and a batch for each epoch: {self}")

    @property
    def epochs(self) -> int:
        return len(self.steps)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """The first step of each epoch, and the run's last step + 1 at the end."""
        return (0, *itertools.accumulate(self.steps))

    @property
    def total_steps(self) -> int:
        return self.starts[-1]

    @property
    def is_uniform(self) -> bool:
        return len(set(self.steps)) == 1 and len(set(self.global_batches)) == 1

    def first_step(self, epoch: int) -> int:
        """Epoch ``epoch``'s first step; past the last epoch, the run's end."""
        return self.starts[min(epoch, self.epochs)]

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, steps into it) of optimizer step ``step``; the run's end is (epochs, 0)."""
        if step >= self.total_steps:
            return self.epochs, step - self.total_steps
        epoch = bisect.bisect_right(self.starts, step) - 1
        return epoch, step - self.starts[epoch]

    def steps_in(self, epoch: int) -> int:
        return self.steps[min(epoch, self.epochs - 1)]

    def global_batch(self, epoch: int) -> int:
        return self.global_batches[min(epoch, self.epochs - 1)]

    def describe(self) -> str:
        """One line for the log: runs of epochs alike, with their global batch and steps."""
        runs: list[list[int]] = []  # [first epoch, last epoch, global batch, steps]
        for e, (steps, batch) in enumerate(zip(self.steps, self.global_batches, strict=True)):
            if runs and runs[-1][2:] == [batch, steps]:
                runs[-1][1] = e
            else:
                runs.append([e, e, batch, steps])
        return "; ".join(
            f"epoch{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}: global batch {batch}, "
            f"{steps} steps each"
            for a, b, batch, steps in runs
        )

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "global_batches": list(self.global_batches)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Plan:
        return cls(tuple(state["steps"]), tuple(state["global_batches"]))
