"""What the trainer does when something other than a step happens: a stop signal, a non-finite
loss, running out of GPU memory.

- **Stop requests:** the first SIGTERM or SIGINT asks the loop to finish its step, checkpoint and
  exit 0 (what torchrun's elastic restarts and cluster schedulers expect); a second one exits at
  once. "Second" means at least ``REPEAT_WINDOW_S`` after the first: a scheduler that signals the
  whole process group and torchrun forwarding the same signal deliver it twice within
  milliseconds, and that must not cost the checkpoint. The handler only sets a flag; the loop
  reads it between steps (one process) or at log steps (several, where the ranks agree on it in
  the log step's collective, so they all stop after the same step).
- **Non-finite losses** are counted on the device and read with each log interval;
  ``--on-nan stop`` writes ``nonfinite.json`` and exits 3 without checkpointing the bad weights,
  ``--on-nan skip`` restores the newest checkpoint in place and trains on.
- **Out of memory:** the weights are those of the last completed step, so one process saves them.
- **A bounded exit:** after a stop request the process has ``watchdog.STOP_BOUND_S`` to end, and
  once ``main`` returns ``EXIT_BOUND_S``; past it, the watchdog prints every thread's stack and
  exits 1, so a hung shutdown never holds a cluster allocation. The trainer shuts its loaders'
  workers down itself (``Loader.close``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from fasttrain.dist.state import DistState
from fasttrain.errors import NonFiniteLoss
from fasttrain.metrics.log import Logged, Metrics
from fasttrain.run import checkpoint as ckpt
from fasttrain.run import resume, watchdog
from fasttrain.step.training import Training

log = logging.getLogger("fasttrain")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 1.0


class StopRequest:
    """SIGTERM / SIGINT while installed: ``requested`` turns true (module notes)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.first_at = 0.0
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers, unless a stop was requested: the
        process is then on its way out, and a second signal while it closes must still end it
        at once with 128 + its number, not by the signal's default action."""
        if self.requested:  # answered: the exit is bounded by the caller's watchdog, if any
            watchdog.disarm()
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            if time.monotonic() - self.first_at < REPEAT_WINDOW_S:
                return  # the same request delivered twice (process group + torchrun)
            os._exit(128 + signum)  # a second request: no checkpoint, now
        self.signum = signum
        self.first_at = time.monotonic()
        watchdog.bound_exit(watchdog.STOP_BOUND_S)  # answered in bounded time, or not at all
        log.warning(
            "%s: finishing the current step, then writing a checkpoint and exiting (send it "
            "again to exit at once; past %.0f s a watchdog ends the process)",
            signal.Signals(signum).name,
            watchdog.STOP_BOUND_S,
        )


class NonFiniteWatch:
    """Reads each logged interval's count of non-finite losses and acts on ``--on-nan``."""

    def __init__(self, policy: str, run_dir: Path, dist: DistState, start_step: int):
        self.policy = policy
        self.run_dir = run_dir
        self.dist = dist
        self.last_finite: dict[str, float] = {}
        self.logged_step = start_step  # the end of the last interval read

    def check(self, logged: list[Logged], now: int, training: Training, metrics: Metrics) -> bool:
        """Act on the intervals just read; whether the ranks asked to stop in them."""
        for entry in logged:
            record = entry.record
            if record["nonfinite_losses"] == 0:
                self.last_finite.update(step=record["step"], loss=record["loss"])
            else:
                self._nonfinite(record, now, training)
                dropped = metrics.discard_pending()  # trained on the weights just replaced
                if dropped is not None:
                    log.info("metrics of the steps up to %d dropped: restored weights", dropped)
            self.logged_step = record["step"]
        return any(entry.stop for entry in logged)

    def _nonfinite(self, record: dict[str, Any], now: int, training: Training) -> None:
        since = self.logged_step
        what = (
            f"the loss became NaN or infinite between steps {since} and {record['step']} "
            f"(LR {record['lr']:.4g}; last finite loss {self.last_finite.get('loss')})"
        )
        diagnostic = {
            "nonfinite_losses": record["nonfinite_losses"],
            "between_steps": [since, record["step"]],
            "lr": record["lr"],
            "last_finite_loss": self.last_finite.get("loss"),
            "last_finite_loss_step": self.last_finite.get("step"),
        }
        self._act(what, diagnostic, now, training)

    def check_state(self, step: int, training: Training) -> bool:
        """Before a checkpoint: whether weights, BN statistics and optimizer state are all
        finite. If not, act on ``--on-nan`` (they can go non-finite a step before the loss
        shows it: the loss is computed before the update), and the step is not saved."""
        bad = ckpt.first_nonfinite(training)
        if bad is None:
            return True
        what = f"{bad} holds NaN or infinite values at step {step}, before its checkpoint"
        self._act(what, {"step": step, "first_nonfinite_tensor": bad}, step, training)
        return False

    def _act(self, what: str, diagnostic: dict[str, Any], now: int, training: Training) -> None:
        """``--on-nan stop``: ``nonfinite.json`` and exit 3, with no checkpoint of the bad state.
        ``--on-nan skip``: restore the newest finite checkpoint in place (the CUDA graph keeps
        reading the same tensors) and go on from the current step."""
        found = ckpt.latest_finite(self.run_dir) if self.policy == "skip" else None
        if found is None:
            if "first_nonfinite_tensor" not in diagnostic:  # after a non-finite loss
                diagnostic["first_nonfinite_tensor"] = ckpt.first_nonfinite(training)
            diagnostic["on_nan"] = self.policy
            if self.dist.is_main:
                text = json.dumps(diagnostic, indent=2) + "\n"
                (self.run_dir / "nonfinite.json").write_text(text)
            raise NonFiniteLoss(
                f"{what}; wrote {self.run_dir / 'nonfinite.json'}"
                + (
                    " (no finite checkpoint to restore for --on-nan skip)"
                    if self.policy == "skip"
                    else ""
                )
                + "; lower --lr or --warmup-epochs up, check the data, or use --on-nan skip"
            )
        path, state = found
        resume.restore_in_place(state, training)
        log.warning(
            "%s: restored the weights and optimizer of %s (step %d) and training on from step "
            "%d (--on-nan skip)",
            what,
            path,
            state["step"],
            now,
        )


def checkpoint_after_oom(
    save: Callable[[], None],
    step: int,
    saved_step: int,
    metrics: Metrics,
    meter_sums: torch.Tensor,
    dist: DistState,
) -> str:
    """After an OOM the weights are those of the last completed step (the failed step never
    reached the optimizer), so they are saved, in one process; what happened, in words.
    ``save`` writes the checkpoint without the loader's state (the loader ran past ``step``)."""
    if dist.distributed:
        return "no checkpoint written (the other ranks wait in a collective; see --dist-timeout)"
    if step == 0 or step == saved_step:
        return "nothing new to checkpoint"
    if dist.device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        # a non-finite loss in the interval in flight or since the last log step: keep out
        in_flight = any(e.record["nonfinite_losses"] for e in metrics.settle())
        if in_flight or meter_sums[2].item() > 0:
            return "no checkpoint written (the loss was not finite)"
        save()
    except Exception as e:
        return f"the checkpoint of step {step} could not be written either ({type(e).__name__})"
    return f"saved a checkpoint of step {step}: --resume auto continues from it"
