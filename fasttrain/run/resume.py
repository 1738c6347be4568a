"""The train state a checkpoint holds, and exact resume from it.

The position in the run is the optimizer step; the epoch and the loader's place in it are
derived from it. Everything here is what ``checkpoint.py`` writes and loads, as plain tensors and
values (``weights_only``-safe).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from fasttrain.config import Config
from fasttrain.errors import UserError, first_line
from fasttrain.step.plan import Plan
from fasttrain.step.training import Training

log = logging.getLogger("fasttrain")


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch and CUDA RNG states, as tensors and plain values (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def train_state(
    cfg: Config,
    training: Training,
    loader_states: list[dict],
    step: int,
    plan: Plan,
    augment_states: list[dict] | None = None,
) -> dict[str, Any]:
    """Everything an exact resume needs. The position is the optimizer step; epoch and the
    loader's place in it are derived from it through ``plan``. ``loader_states``: one per rank
    (DALI's reader state; empty for loaders whose position follows from the step);
    ``augment_states``: the batch augmentations' generator states by name
    (``Training.augments``), one dict per rank."""
    epoch, in_epoch = plan.locate(step)
    return {
        "model": training.model.state_dict(),  # the raw module: no _orig_mod. or module. prefixes
        "model_ema": training.ema.state_dict() if training.ema is not None else None,
        "augment_rng": augment_states,  # the batch augmentations' generators, per rank
        "optimizer": _optimizer_state(training.optimizer),
        "scaler": training.scaler.state_dict() if training.scaler is not None else None,
        "step": step,
        "epoch": epoch,
        "loader": {
            "epoch": epoch,
            "start_batch": in_epoch * cfg.train.accum_steps,
            "steps_per_epoch": plan.steps_in(epoch),
        },
        "loader_state": loader_states,
        "world_size": len(loader_states),
        "global_batch": plan.global_batch(epoch),
        "plan": plan.state_dict(),
        "rng": rng_state(),
        "config": cfg.to_dict(),
    }


def saved_plan(state: dict[str, Any], epochs: int) -> Plan:
    """The checkpoint's epochs as steps, over ``epochs`` epochs: its plan (a later epoch takes
    the last one's steps and batch: a schedule's final size holds), or, from a checkpoint
    without one, its steps per epoch and global batch throughout."""
    if "plan" not in state:
        spe, batch = int(state["loader"]["steps_per_epoch"]), int(state.get("global_batch", 0))
        return Plan.uniform(spe, batch, epochs)
    saved = Plan.from_state_dict(state["plan"])
    more = max(0, epochs - saved.epochs)
    return Plan(
        (saved.steps + saved.steps[-1:] * more)[:epochs],
        (saved.global_batches + saved.global_batches[-1:] * more)[:epochs],
    )


def finished(state: dict[str, Any], cfg: Config) -> bool:
    """Whether the checkpoint ``state`` is the end of the run ``cfg`` describes: its step is the
    last of ``--epochs`` (in the checkpoint's own steps per epoch) or past ``--max-steps``."""
    total = saved_plan(state, cfg.train.epochs).total_steps
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    return int(state["step"]) >= total


def restore_augments(state: dict[str, Any], training: Training, rank: int, world: int) -> None:
    """This rank's batch-augmentation generators from a checkpoint of the same world size; at
    another world size, or where the checkpoint has none, they keep their fresh seeds (said)."""
    augments = training.augments()
    if not augments:
        return
    saved = state.get("augment_rng")
    mine = saved[rank] if saved is not None and len(saved) == world else {}
    fresh = [name for name in augments if name not in mine]
    for name, augment in augments.items():
        if name in mine:
            augment.load_state_dict(mine[name])
    if fresh and rank == 0:
        log.info(
            "%s: the checkpoint holds no generator state for %d process%s; these draws start "
            "afresh from --seed",
            ", ".join({"mix": "mixup/CutMix", "erase": "random erasing"}[n] for n in fresh),
            world,
            "es" if world > 1 else "",
        )


def loader_state_for(state: dict[str, Any], rank: int, world_size: int) -> dict | None:
    """This rank's loader state from a checkpoint, if it was saved at the same world size."""
    states = state.get("loader_state")
    if not states or len(states) != world_size:
        return None
    return states[rank] or None


def resume(
    path: str,
    state: dict[str, Any],
    cfg: Config,
    training: Training,
    plan: Plan,
) -> int:
    """Load model, optimizer, scaler and RNG states; return the step to continue from.

    At another global batch (another world size), the step is converted through the images
    seen: the same epoch, and as far into it as the saved run had trained (rounded down)."""
    _warn_config_changes(state["config"], cfg.to_dict())
    try:
        training.model.load_state_dict(state["model"])
    except RuntimeError as e:  # another architecture or class count: torch's message is a page
        arch = state["config"].get("model", {}).get("arch")
        head = state["model"].get("fc.bias")
        classes = head.numel() if head is not None else "?"
        first = first_line(str(e).partition("\n")[2])  # the line after torch's heading
        raise UserError(
            f"--resume {path}: its model ({arch}, {classes} classes) does not fit this run's "
            f"({cfg.model.arch}, "
            f"{training.model.fc.out_features} classes): {first.rstrip('.')}; resume with the "
            "checkpoint's --arch and --num-classes, or start without --resume"
        ) from None
    if training.ema is not None:
        if state.get("model_ema") is not None:
            training.ema.load_state_dict(state["model_ema"])
        else:
            training.ema.load_state_dict(state["model"])
            log.info("--model-ema: %s holds no average; it starts from the model's weights", path)
    training.optimizer.load_state_dict(state["optimizer"])
    if training.scaler is not None and state.get("scaler") is not None:
        training.scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    step = int(state["step"])
    epoch, in_epoch = saved_plan(state, max(plan.epochs, int(state["epoch"]) + 1)).locate(step)
    global_batch = plan.global_batch(epoch)
    saved_batch = int(state.get("global_batch", global_batch))
    if saved_batch != global_batch:
        new_step = plan.first_step(epoch) + in_epoch * saved_batch // global_batch
        log.warning(
            "resuming at global batch %d, the checkpoint's was %d (another world size): step %d "
            "becomes step %d, in epoch %d; the LR schedule follows the new global batch",
            global_batch,
            saved_batch,
            step,
            new_step,
            epoch,
        )
        step = new_step
    log.info("resumed from %s at step %d (epoch %d)", path, step, state["epoch"])
    return step


def restore_in_place(state: dict[str, Any], training: Training) -> None:
    """Copy a checkpoint's weights and momentum into the tensors the step already holds (a CUDA
    graph keeps reading the same addresses)."""
    training.model.load_state_dict(state["model"])  # copies into the same tensors
    optimizer = training.optimizer
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        old = state["optimizer"]["state"].get(i, {}).get("momentum_buffer")
        if buf is not None and old is not None:
            buf.copy_(old)
        elif old is not None:
            optimizer.state[p]["momentum_buffer"] = old.to(p.device).clone()
    if training.scaler is not None and state.get("scaler") is not None:
        training.scaler.load_state_dict(state["scaler"])


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with the LR as a float: the graphed step keeps it in a device
    tensor, and a checkpoint should resume the same under any step."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:  # state_dict() copies each group: the optimizer keeps its
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


# config a resume may change without a word (sections or "section.key")
RESUME_MAY_CHANGE = {"run", "data.workers", "train.max_steps"}


def _warn_config_changes(old: dict, new: dict) -> None:
    """A resume with other training settings is allowed, but not silently."""
    ignore = RESUME_MAY_CHANGE
    changed = [
        f"{s}.{k}: {v!r} -> {new[s][k]!r}"
        for s, body in old.items()
        if s not in ignore and s in new
        for k, v in body.items()
        if f"{s}.{k}" not in ignore and k in new[s] and new[s][k] != v
    ]
    if changed:
        log.warning(
            "resuming with settings that differ from the checkpoint's: %s", "; ".join(changed)
        )
