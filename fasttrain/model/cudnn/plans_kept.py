"""The plan ``select_fastest`` chose for each cuDNN graph, kept in a file beside the compile
cache, so that a later start builds that one plan instead of building and timing every plan
cuDNN ranks (a few hundred milliseconds a start for ResNet-50's graphs).

An entry is keyed by the graph's own description (what its caller passes: shapes, strides,
data types, fusions), cuDNN's and the frontend's versions and the GPU's name, and holds the
chosen plan's index among the plans cuDNN ranked and how many there were: a count that differs
(another heuristics' ranking) misses, and the graph is timed again. A kept plan that no longer
builds is timed again too. Ranks write the same choices for the same graphs; each write
replaces the file whole (a temporary file renamed), so a reader never sees half of one.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from fasttrain.files import write_whole

log = logging.getLogger("fasttrain")

_lock = threading.Lock()  # the convolutions' warm-up thread selects plans beside the step's
_path: Path | None = None
_kept: dict[str, list[int]] = {}  # key -> [index, count]


def keep_plans(path: Path | None) -> None:
    """Keep the chosen plans in ``path`` (a JSON file), reading what an earlier start kept
    there; None keeps none (each start times every graph's plans)."""
    global _path, _kept
    with _lock:
        _path, _kept = path, {}
        if path is None or not path.exists():
            return
        try:
            kept = json.loads(path.read_text())
        except (OSError, ValueError) as e:  # a damaged file costs only the timing
            log.warning("cuDNN's kept plans in %s are unreadable (%s): timing them again", path, e)
            return
        if isinstance(kept, dict):
            _kept = {k: v for k, v in kept.items() if _is_entry(v)}


def _is_entry(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(isinstance(i, int) for i in v)


def full_key(graph_key: tuple, device: Any) -> str:
    """``graph_key`` with what else decides cuDNN's ranking: its version, the frontend's and
    the GPU."""
    import cudnn
    import torch

    return json.dumps(
        [
            list(graph_key),
            int(cudnn.backend_version()),
            cudnn.__version__,
            torch.cuda.get_device_name(device),
        ],
        default=str,
    )


def kept_plan(key: str, count: int) -> int | None:
    """The plan kept for ``key`` among ``count`` ranked plans, or None."""
    with _lock:
        entry = _kept.get(key)  # empty where no file is kept
    if entry is None or entry[1] != count or not 0 <= entry[0] < count:
        return None
    return entry[0]


def keep(key: str, index: int, count: int) -> None:
    """Remember ``index`` of ``count`` for ``key``, and write the file (where one is kept)."""
    with _lock:
        if _path is None or _kept.get(key) == [index, count]:
            return
        _kept[key] = [index, count]
        try:
            write_whole(_path, json.dumps(_kept, indent=0, sort_keys=True).encode())
        except OSError as e:  # a read-only cache: the next start times the plans again
            log.debug("cuDNN's chosen plans not kept in %s: %s", _path, e)
