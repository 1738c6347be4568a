"""Atomic checkpoints, the train state they hold, and exact resume.

A checkpoint is written to a temporary file in the same directory, flushed, fsynced and renamed
over its final name, then the directory is fsynced: a crash at any point leaves either the old set
of checkpoints or the new one, never a half-written file under a checkpoint's name. Everything in
it loads with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fasttrain.config import Config, RunConfig
from fasttrain.errors import CheckpointWriteError, UserError, first_line

if TYPE_CHECKING:
    from fasttrain.builder import Training

log = logging.getLogger("fasttrain")
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
WRITER_FAILED = re.compile(r"PytorchStreamWriter failed|file write failed|unexpected pos")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, newest (highest step) first."""
    if not Path(directory).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About what one checkpoint takes on disk: the model's state, and SGD's momentum (one fp32
    value per parameter; the optimizer has not made it yet when this is asked, before step 1)."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return state + sum(4 * p.numel() for p in model.parameters())


def check_free_space(directory: Path, need: int, keep: int) -> None:
    """Refuse to start when the output directory cannot hold one more checkpoint (a full disk
    found before training, not at the first save); warn when it cannot hold ``keep`` of them."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:  # a filesystem that will not say: the write probe and the loud save remain
        return
    mib = 2**20
    if free < need:
        raise UserError(
            f"--output-dir {directory}: {free / mib:,.0f} MiB free, and a checkpoint takes about "
            f"{need / mib:,.0f} MiB; free some space or choose another --output-dir"
        )
    if free < need * keep:
        log.warning(
            "--output-dir %s: %.0f MiB free holds fewer than --keep-checkpoints %d checkpoints "
            "of about %.0f MiB; a later save may fail (it will say so and keep the previous one)",
            directory,
            free / mib,
            keep,
            need / mib,
        )


def save_checkpoint(state: dict[str, Any], directory: Path, step: int, keep: int) -> Path:
    """Write ``state`` atomically as ckpt-<step>.pt, then delete all but the newest ``keep``."""
    directory = Path(directory)
    path = checkpoint_path(directory, step)
    tmp = directory / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[keep:]:
        if old != path:  # never the one just written (set_aside keeps later steps away)
            old.unlink(missing_ok=True)
    return path


def set_aside(directory: Path, start_step: int) -> list[Path]:
    """Prepare ``directory`` for a run that starts at ``start_step``: checkpoints of later steps
    belong to a run this one branches away from (a resume from an older step, or a fresh start
    in a used folder). They would win ``--resume auto`` and, newest by step, make pruning delete
    every checkpoint this run writes; they move to ``abandoned-<time>/``. Temporary files of
    writers that died mid-write are removed. Returns the checkpoints moved."""
    directory = Path(directory)
    for tmp in directory.glob(".ckpt-*.pt.tmp-*"):
        tmp.unlink(missing_ok=True)
        log.info("removed %s, left by a checkpoint write that did not finish", tmp.name)
    later = [
        p for p in list_checkpoints(directory) if int(_NAME.match(p.name).group(1)) > start_step
    ]
    if not later:
        return []
    aside = directory / time.strftime("abandoned-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for path in later:
        os.replace(path, aside / path.name)
    log.warning(
        "this run starts at step %d, and %s held checkpoints of later steps (%s) from a run it "
        "branches away from: moved to %s, so that they neither win --resume auto nor push this "
        "run's checkpoints out",
        start_step,
        directory,
        ", ".join(p.name for p in later),
        aside,
    )
    return later


def _read(path: Path) -> dict[str, Any]:
    """Load one checkpoint; raises ``ValueError`` saying what is wrong with it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, not a torch file...
        raise ValueError(
            f"the checkpoint is corrupt or not a fasttrain checkpoint ({type(e).__name__})"
        ) from None
    missing = {"model", "optimizer", "step", "epoch", "loader", "config"} - set(state)
    if missing:
        raise ValueError(f"not a fasttrain checkpoint (missing {', '.join(sorted(missing))})")
    return state


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load and check the checkpoint ``--resume`` names; a bad file is a ``UserError`` naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--resume {path}: no such checkpoint file")
    try:
        return _read(path)
    except ValueError as e:
        raise UserError(f"--resume {path}: {e}; pick another or start afresh") from None


def latest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that loads; corrupt ones are skipped; warned."""
    for path in list_checkpoints(directory):
        try:
            return path, _read(path)
        except ValueError as e:
            log.warning("--resume auto: skipping %s: %s", path, e)
    return None


def _first_nonfinite(named: list[tuple[str, Any]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or infinity; None when all are
    finite. Checked where the tensors are (on the device), read with one host copy."""
    floats = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point()]
    floats = [(n, t) for n, t in floats if t.numel()]
    if not floats:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()
    return next((n for (n, _), ok in zip(floats, finite, strict=True) if not ok), None)


def first_nonfinite(training: Training) -> str | None:
    """The first of the model's parameters and buffers, then the optimizer's state, holding NaN
    or infinity; None when all are finite."""
    named = list(training.model.state_dict().items())
    params = {id(p): n for n, p in training.model.named_parameters()}
    for p, state in training.optimizer.state.items():
        name = params.get(id(p), "a parameter")
        named += [(f"optimizer {key} of {name}", value) for key, value in state.items()]
    return _first_nonfinite(named)


def _finite(state: dict[str, Any]) -> bool:
    """Whether a loaded checkpoint's model and optimizer tensors are all finite."""
    named = list(state["model"].items())
    for i, entry in state["optimizer"].get("state", {}).items():
        named += [(f"optimizer {key} of {i}", value) for key, value in entry.items()]
    return _first_nonfinite(named) is None


def latest_finite(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and holds only finite values (``--on-nan skip``)."""
    for path in list_checkpoints(directory):
        try:
            state = _read(path)
        except ValueError as e:
            log.warning("--on-nan skip: skipping %s: %s", path, e)
            continue
        if _finite(state):
            return path, state
        log.warning("--on-nan skip: skipping %s: it holds NaN or infinite values", path)
    return None


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


# ---- the train state: what a checkpoint holds, and resuming from it ---------------------------


def train_state(
    cfg: Config,
    training: Training,
    loader_states: list[dict],
    step: int,
    steps_per_epoch: int,
    global_batch: int,
    augment_states: list[dict] | None = None,
) -> dict[str, Any]:
    """Everything an exact resume needs. The position is the optimizer step; epoch and the
    loader's place in it are derived from it. ``loader_states``: one per rank (DALI's reader
    state; empty for loaders whose position follows from the step); ``augment_states``: the
    batch augmentations' generator states by name (``Training.augments``), one dict per
    rank."""
    epoch, in_epoch = divmod(step, steps_per_epoch)
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
            "steps_per_epoch": steps_per_epoch,
        },
        "loader_state": loader_states,
        "world_size": len(loader_states),
        "global_batch": global_batch,
        "rng": rng_state(),
        "config": cfg.to_dict(),
    }


def write(state: dict[str, Any], run_dir: Path, keep: int) -> Path:
    """``save_checkpoint``, with a failed write (a full disk, a lost mount) as one line that says
    the previous checkpoint is intact."""
    step = state["step"]
    try:
        return save_checkpoint(state, run_dir, step, keep)
    except (OSError, RuntimeError) as e:
        # a full disk reaches torch.save's zip writer as a RuntimeError ("PytorchStreamWriter
        # failed writing file ...: file write failed"); any other RuntimeError is a bug
        if isinstance(e, RuntimeError) and not WRITER_FAILED.search(str(e)):
            raise
        previous = list_checkpoints(run_dir)
        reason = (
            e.strerror
            if isinstance(e, OSError) and e.strerror
            else first_line(str(e), type(e).__name__)
        )
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {step} in {run_dir} ({reason}); "
            + (f"{previous[0].name} is intact" if previous else "no earlier checkpoint exists")
            + ": free space or point --output-dir elsewhere, then --resume auto"
        ) from None


def find_resume(run: RunConfig) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint ``--resume`` names (or the newest valid one, for 'auto'), loaded."""
    if run.resume is None:
        return None
    if run.resume == "auto":
        found = latest_valid(run.output_dir)
        return (str(found[0]), found[1]) if found is not None else None
    return run.resume, load_checkpoint(run.resume)


def finished(state: dict[str, Any], cfg: Config) -> bool:
    """Whether the checkpoint ``state`` is the end of the run ``cfg`` describes: its step is the
    last of ``--epochs`` (in the checkpoint's own steps per epoch) or past ``--max-steps``."""
    total = int(state["loader"]["steps_per_epoch"]) * cfg.train.epochs
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
    global_batch: int,
    steps_per_epoch: int,
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
    saved_batch = int(state.get("global_batch", global_batch))
    if saved_batch != global_batch:
        epoch, in_epoch = divmod(step, int(state["loader"]["steps_per_epoch"]))
        new_step = epoch * steps_per_epoch + in_epoch * saved_batch // global_batch
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
