"""Weights in and out of a model: a state dict read from a file and loaded before training or
evaluation (``--weights``, ``evaluate``), and the model's weights written as torchvision's
state dict (``export``).

A weights file may be a plain state dict (torchvision's, or an ``export``), a fasttrain
checkpoint (the state under ``model``), or a timm-style checkpoint (under ``state_dict``). Keys
written by a wrapper (``module.`` from DDP, ``_orig_mod.`` from ``torch.compile``) are taken
without their prefix. Nothing is downloaded: the file is the user's.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fasttrain.errors import UserError

log = logging.getLogger("fasttrain")

PREFIXES = ("module.", "_orig_mod.")
# what a file that pickles more than tensors is told: never torch's own advice, which is to load it
# with weights_only=False, the one thing that runs the file's code
NEEDS_CODE = (
    "it holds Python objects that need code to load, not only tensors; fasttrain loads weights "
    "only and refuses such files: save the weights alone, torch.save(model.state_dict(), PATH)"
)


def needs_code(e: BaseException) -> bool:
    """Whether ``torch.load(..., weights_only=True)`` refused a file for the code it needs: a
    pickled class or function it does not allow ("Unsupported global"), not bytes that are no
    pickle at all ("Unsupported operand")."""
    return isinstance(e, pickle.UnpicklingError) and "unsupported global" in str(e).lower()


CONTAINER_KEYS = ("model", "state_dict", "model_state_dict")  # fasttrain, timm, common scripts
CLASSIFIER = ("fc.weight", "fc.bias")  # torchvision ResNets' last layer


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items())
    )


def read_state_dict(
    path: str | Path, flag: str = "--weights", key: str | None = None
) -> dict[str, Tensor]:
    """The state dict a weights file holds (module notes), on the CPU; a file that is not one is
    a one-line error naming ``flag``. ``key``: take the checkpoint's state under that key
    instead (``model_ema``: a --model-ema run's average)."""
    return state_dict_in(load_file(path, flag), path, flag, key)


def load_file(path: str | Path, flag: str = "--weights") -> Any:
    """What a weights file holds, loaded with ``weights_only=True`` on the CPU; a file that
    cannot be read so is a one-line error naming ``flag``, never with advice to load it
    unsafely."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and torch's own errors all mean "not a weights file"
        if needs_code(e):
            raise UserError(f"{flag} {path}: {NEEDS_CODE}") from None
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if "weights_only" in first:  # torch's advice to load unsafely is never passed on
            first = type(e).__name__
        raise UserError(
            f"{flag} {path}: torch.load cannot read it as weights ({first}); give a state dict "
            "saved with torch.save, or a checkpoint holding one"
        ) from None


def holds_average(obj: Any) -> bool:
    """Whether a loaded checkpoint holds a --model-ema run's moving average of the weights."""
    return isinstance(obj, Mapping) and _is_state_dict(obj.get("model_ema"))


def state_dict_in(
    obj: Any, path: str | Path, flag: str = "--weights", key: str | None = None
) -> dict[str, Tensor]:
    """The state dict in what ``load_file`` read (see ``read_state_dict``)."""
    if key is not None:
        if not (isinstance(obj, Mapping) and _is_state_dict(obj.get(key))):
            what = "EMA weights (train with --model-ema)" if key == "model_ema" else repr(key)
            raise UserError(f"{flag} {path}: the file holds no {what}")
        obj = obj[key]
    if isinstance(obj, Mapping) and not _is_state_dict(obj):
        obj = next((obj[k] for k in CONTAINER_KEYS if _is_state_dict(obj.get(k))), obj)
    if not _is_state_dict(obj):
        raise UserError(
            f"{flag} {path}: not a state dict (a mapping of parameter names to tensors) nor a "
            f"checkpoint holding one under {', '.join(repr(k) for k in CONTAINER_KEYS)}"
        )
    return {_strip(k): v for k, v in obj.items()}


def classifier_classes(state: Mapping[str, Tensor]) -> int | None:
    """How many classes the state's classifier (``fc``) has, if it has one."""
    w = state.get(CLASSIFIER[0])
    return int(w.shape[0]) if w is not None and w.dim() == 2 else None


def load_weights(model: nn.Module, state: Mapping[str, Tensor], source: str) -> bool:
    """Copy ``state`` into ``model``. A classifier for another number of classes is left out
    (the model's new one trains from scratch) and said; any other missing, extra or misshapen
    key is a one-line error. Returns whether the classifier was replaced."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    misshapen = [k for k in own if k in state and state[k].shape != own[k].shape]
    replace = bool(misshapen) and set(misshapen) <= set(CLASSIFIER)
    if missing or extra or (misshapen and not replace):
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's keys missing (e.g. {missing[0]!r})")
        if extra:
            parts.append(f"{len(extra)} keys the model does not have (e.g. {extra[0]!r})")
        bad = [k for k in misshapen if k not in CLASSIFIER]
        if bad:
            k = bad[0]
            parts.append(
                f"{len(bad)} of another shape (e.g. {k!r}: {tuple(state[k].shape)} in the file, "
                f"{tuple(own[k].shape)} in the model)"
            )
        raise UserError(
            f"{source}: not weights for this model ({'; '.join(parts)}); check --arch (or "
            "--model) against the architecture the file was trained as"
        )
    keep = {k: v for k, v in state.items() if not (replace and k in CLASSIFIER)}
    model.load_state_dict(keep, strict=not replace)
    if replace:
        log.info(
            "%s: its classifier has %d classes, this model %d: the classifier (fc) starts from "
            "scratch, every other layer from the file",
            source,
            state[CLASSIFIER[0]].shape[0],
            own[CLASSIFIER[0]].shape[0],
        )
    return replace


def export_state_dict(state: Mapping[str, Tensor], path: str | Path) -> Path:
    """Write ``state`` as a plain state dict: ``.safetensors`` (the safetensors package) or a
    torch file. Unwritable paths and a missing package are one-line errors."""
    path = Path(path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise UserError(
                    f"{path}: writing .safetensors needs the safetensors package (pip install "
                    "safetensors); or give a .pt path"
                ) from None
            save_file(tensors, str(path))
        else:
            torch.save(tensors, path)
    except OSError as e:
        raise UserError(
            f"{path}: cannot write there ({e.strerror}); choose a writable path"
        ) from None
    return path
