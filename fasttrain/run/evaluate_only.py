"""``python -m fasttrain evaluate WEIGHTS`` (or ``--test-only --weights WEIGHTS``): top-1/top-5 of
a weights file on a val set, training nothing.

The same flags as training choose the model (``--arch``, ``--fused-bn``), the loader (DALI or
torchvision), the device, the precision, ``--compile`` and ``--cuda-graphs`` (the eval forward
compiled and captured as in training), and the processes (``--nproc-per-node``, torchrun): each
rank evaluates its shard and the counts are summed, so every image counts once. The class count
comes from the file's classifier unless ``--num-classes`` says otherwise. The result is logged
and written to ``<output-dir>/eval.json``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from fasttrain.config import Config
from fasttrain.data.build import build_eval_data
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError
from fasttrain.model.build import build_configured_model
from fasttrain.run.build import amp_dtype, build_evaluator
from fasttrain.run.runtime import (
    configure_backends,
    discard_run_dir,
    prepare_run_dir,
    seed_everything,
)
from fasttrain.run.weights import classifier_classes, load_weights, read_state_dict

log = logging.getLogger("fasttrain")


def evaluate_only(cfg: Config, dist: DistState) -> dict[str, Any]:
    """Evaluate ``cfg.model.weights`` on ``cfg.data``'s val images; returns the result."""
    t = cfg.train
    run_dir, created = prepare_run_dir(cfg, dist)
    try:  # a bad input leaves no run folder behind
        configure_backends(dist.device, t.strategy, t.deterministic)
        seed_everything(t.seed)
        source = f"--weights {cfg.model.weights}"
        state = read_state_dict(cfg.model.weights)
        val, classes, description = build_eval_data(
            cfg.data,
            batch_size=t.batch_size,
            dist=dist,
            dtype=amp_dtype(cfg) or torch.float32,
            channels_last=cfg.model.channels_last,
            triton_normalize="normalize" in cfg.typed.kernels,
        )
        in_file = classifier_classes(state)
        num_classes = cfg.model.num_classes or in_file or classes
        if num_classes < classes:
            raise UserError(
                f"--data {cfg.data.path}: {classes} class folders, but the model has "
                f"{num_classes} classes; evaluate on a val set of the classes it was trained on"
            )
        model = build_configured_model(cfg.model, num_classes, dist.device, cfg.typed.kernels)
        if load_weights(model, state, source):
            raise UserError(
                f"{source}: its classifier has {in_file} classes and --num-classes is "
                f"{num_classes}; evaluation needs the file's own classifier: leave "
                "--num-classes out"
            )
        evaluator = build_evaluator(cfg, dist, model, t.batch_size)
    except UserError:
        if created:
            discard_run_dir(run_dir, dist)
        raise
    log.info("%s, %d classes | %s", cfg.model.arch, num_classes, description)
    try:
        result = evaluator(val)
    finally:
        val.close()
    result.update(weights=str(cfg.model.weights), data=str(cfg.data.path), arch=cfg.model.arch)
    if dist.is_main:
        (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        log.info(
            "evaluated %s: top-1 %.2f%%, top-5 %.2f%% over %d images | %s",
            cfg.model.weights,
            result["top1"],
            result["top5"],
            result["images"],
            run_dir / "eval.json",
        )
    return result
