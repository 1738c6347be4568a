"""The plan ``select_fastest`` chose for each cuDNN graph, remembered on disk across runs.

Choosing a plan builds every plan cuDNN ranks for the graph (each build compiles a kernel, about
0.3 s) and times them: for the fused path's graphs, most of a warm start's first step. cuDNN
keeps nothing between processes, so a run that finds its graph here builds only the plan that
won before. The key is the graph's own description (its JSON: every tensor's shape, stride and
type, every node), the GPU's name and the cuDNN and frontend versions: a change of any of them
misses, and the run times the plans again. A remembered plan is also checked by name at its
index before it is used. The file is ``$FASTTRAIN_CACHE/cudnn-plans.json``; ranks and runs
that write it at once merge, and at worst one of them loses an entry, which is timed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from fasttrain.config.paths import cache_dir

log = logging.getLogger("fasttrain")


def path() -> Path:
    return cache_dir() / "cudnn-plans.json"


def context() -> list[str]:
    """What a plan's choice depends on beside the graph: the GPU and the cuDNN versions."""
    import cudnn

    name = torch.cuda.get_device_name(torch.cuda.current_device())
    return [name, str(cudnn.backend_version()), getattr(cudnn, "__version__", "?")]


def key(graph: Any) -> str:
    """The graph's key: its description, the GPU and the versions (module notes)."""
    parts = [repr(graph), *context()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _read() -> dict[str, dict]:
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def recall(graph: Any) -> int | None:
    """The index of the plan that won for this graph before, if it is still that plan."""
    entry = _read().get(key(graph))
    if not isinstance(entry, dict) or not isinstance(entry.get("index"), int):
        return None
    index = entry["index"]
    try:
        if index >= graph.get_execution_plan_count():
            return None
        if graph.get_plan_name_at_index(index) != entry.get("name"):
            return None
    except Exception:  # a frontend that cannot say: time the plans again
        return None
    return index


def remember(graph: Any, index: int) -> None:
    """Keep ``index`` as this graph's plan (merged into the file, written atomically)."""
    try:
        entry = {"index": index, "name": graph.get_plan_name_at_index(index)}
        data = _read()
        data[key(graph)] = entry
        target = path()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, target)
    except Exception as e:  # a read-only cache costs the next start time, not this run
        log.debug("cuDNN plan not remembered: %s", e)
