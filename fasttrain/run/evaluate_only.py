"""``python -m fasttrain evaluate WEIGHTS`` (or ``--test-only --weights WEIGHTS``): top-1/top-5 of
a weights file on a val set, training nothing.

The same flags as training choose the model (``--arch``, ``--fused-bn``), the loader (DALI or
torchvision), the device, the precision, ``--compile`` and ``--cuda-graphs`` (the eval forward
compiled and captured as in training), and the processes (``--nproc-per-node``, torchrun): each
rank evaluates its shard and the counts are summed, so every image counts once. The class count
comes from the file's classifier unless ``--num-classes`` says otherwise. With ``--model-ema``
the checkpoint's moving average of the weights is evaluated (what a --model-ema run reports as
``ema_top1``), else its model's weights; the log says which. The result is logged and written to
``<output-dir>/eval.json``.
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
from fasttrain.run.compile_cache import configure_compile_caches
from fasttrain.run.folder import open_run_folder
from fasttrain.run.runtime import configure_backends, seed_everything
from fasttrain.run.weights import (
    classifier_classes,
    holds_average,
    load_file,
    load_weights,
    state_dict_in,
)

log = logging.getLogger("fasttrain")


def evaluate_only(cfg: Config, dist: DistState) -> dict[str, Any]:
    """Evaluate ``cfg.model.weights`` on ``cfg.data``'s val images; returns the result."""
    t = cfg.train
    folder = open_run_folder(cfg, dist)
    run_dir = folder.path
    try:  # a bad input leaves no run folder behind
        configure_backends(dist.device, t.strategy, t.deterministic)
        if t.compile:
            configure_compile_caches(cfg, dist.world_size)
        seed_everything(t.seed)
        source = f"--weights {cfg.model.weights}"
        loaded = load_file(cfg.model.weights)
        which = "model_ema" if t.model_ema else None
        state = state_dict_in(loaded, cfg.model.weights, key=which)
        if t.model_ema:
            log.info("%s: evaluating the moving average of its weights (--model-ema)", source)
        elif holds_average(loaded):
            log.info(
                "%s: evaluating the model's weights; the file also holds their moving average, "
                "which --model-ema evaluates",
                source,
            )
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
        folder.discard(dist)
        raise
    except BaseException:
        folder.release()
        raise
    log.info("%s, %d classes | %s", cfg.model.arch, num_classes, description)
    try:
        try:
            result = evaluator(val)
        finally:
            val.close()
        result.update(
            weights=str(cfg.model.weights),
            average=t.model_ema,
            data=str(cfg.data.path),
            arch=cfg.model.arch,
        )
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
    finally:
        folder.release()
    return result
