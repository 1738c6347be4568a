"""The training loop: epochs of optimizer steps, with log, eval and checkpoint cadence.

Everything else (data, model, step, metrics, checkpoints) is built by the modules named below; this
file only says when each happens. The position in the run is the optimizer step: epoch and
position inside the epoch are derived from it, which is what makes resume exact.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from typing import Any

import torch

from fasttrain import checkpoint as ckpt
from fasttrain.config import Config, inductor_options, save_resolved, triton_kernels
from fasttrain.data import build_data
from fasttrain.distributed import DistState
from fasttrain.errors import UserError
from fasttrain.evaluate import Evaluator
from fasttrain.metrics import DeviceMeter, Logged, Metrics, peak_memory_gib
from fasttrain.model import build_configured_model
from fasttrain.optim import build_optimizer, build_schedule
from fasttrain.parallel import average_bn_statistics, ddp_description, wrap_model
from fasttrain.profiling import RunProfiler, StepTimer, configure, span
from fasttrain.runtime import configure_backends, prepare_run_dir, seed_everything
from fasttrain.signals import StopRequest
from fasttrain.step import build_loss, build_step, compile_kwargs

log = logging.getLogger("fasttrain")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


class OutOfMemory(UserError):
    exit_code = 1


class NonFiniteLoss(UserError):
    exit_code = 3


class CheckpointWriteError(UserError):
    exit_code = 1


def train(cfg: Config, dist: DistState, t_start: float | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; returns the run summary (also written to summary.json)."""
    t_start = time.perf_counter() if t_start is None else t_start
    t, r = cfg.train, cfg.run
    run_dir = prepare_run_dir(cfg, dist)
    configure(record=r.profile, nvtx=dist.device.type == "cuda")
    log.debug("rank %d of %d: process %d", dist.rank, dist.world_size, os.getpid())
    configure_backends(dist.device, t.strategy)
    seed_everything(t.seed)
    amp_dtype = AMP_DTYPES[t.amp]
    kernels = triton_kernels(t.triton_kernels)
    resumed = _find_resume(cfg)  # before the data: a DALI pipeline restores when it is built
    if t.batch_size is None:
        from fasttrain.autobatch import auto_batch_size

        t.batch_size = auto_batch_size(cfg, dist, resumed, amp_dtype, kernels)
        seed_everything(t.seed)  # the trials drew from the RNG; the run starts as if they had not
        if dist.is_main:
            save_resolved(cfg, run_dir / "config.yaml")  # the number, so the file reproduces it
    # --batch-size is per GPU: DataParallel's one process feeds every GPU from one loader batch
    replicas = torch.cuda.device_count() if t.strategy == "dp" else 1
    loader_batch = t.batch_size * replicas
    gpus = dist.world_size * replicas
    global_batch = loader_batch * dist.world_size * t.accum_steps

    # ---- build -------------------------------------------------------------------------------
    data = build_data(
        cfg.data,
        batch_size=loader_batch,
        num_classes=cfg.model.num_classes,
        seed=t.seed,
        dist=dist,
        dtype=amp_dtype or torch.float32,
        channels_last=cfg.model.channels_last,
        accum_steps=t.accum_steps,
        triton_normalize="normalize" in kernels,
        loader_state=_loader_state(resumed[1], dist) if resumed else None,
    )
    steps_per_epoch = len(data.train) // t.accum_steps
    if steps_per_epoch == 0:
        raise UserError(
            f"--accum-steps {t.accum_steps}: an epoch has only {len(data.train)} "
            "batches, fewer than one optimizer step; lower it or --batch-size"
        )
    model = build_configured_model(cfg.model, data.num_classes, dist.device, kernels)
    net = wrap_model(model, t, dist)  # what the step trains; checkpoints and eval use ``model``
    schedule = build_schedule(cfg.optim, global_batch, steps_per_epoch, t.epochs)
    optimizer = build_optimizer(model, cfg.optim, schedule.lr_at(0), triton="sgd" in kernels)
    criterion, scaler = build_loss(cfg.optim.label_smoothing, t.amp, xent="xent" in kernels)
    if dist.is_main:  # a full disk is a one-line error now, not at the first save
        ckpt.check_free_space(run_dir, ckpt.checkpoint_bytes(model), cfg.run.keep_checkpoints)
    compile_options = compile_kwargs(t.compile_mode, inductor_options(t.inductor_options))
    tunes = "autotune" in t.compile_mode or compile_options.get("options", {}).get(
        "coordinate_descent_tuning"
    )
    if t.compile and tunes and dist.is_main:
        log.info(
            "--compile-mode %s, --inductor-options %s: the first start benchmarks inductor's "
            "kernel choices (about 5 minutes for ResNet-50 on an H200; max-autotune about 9); "
            "later starts reuse inductor's cache. --compile-mode default --inductor-options none "
            "compiles in under a minute, about 5%% slower per step",
            t.compile_mode,
            t.inductor_options,
        )
    train_step = build_step(
        model=net,
        optimizer=optimizer,
        criterion=criterion,
        amp_dtype=amp_dtype,
        scaler=scaler,
        schedule=schedule,
        compile=t.compile,
        compile_options=compile_options,
        cuda_graphs=t.cuda_graphs,
        # DDP rebuilds its buckets after the first steps: capture after 11 (PyTorch CUDA notes)
        graph_warmup=11 if t.strategy == "ddp" else 3,
        fixed_inputs=getattr(data.train, "fixed_buffers", False),
    )
    evaluator = (
        Evaluator(
            model,
            amp_dtype,
            t.compile,
            loader_batch,
            compile_options=compile_options,
            cuda_graphs=t.cuda_graphs,
            dist=dist,
        )
        if data.val is not None and r.eval_every > 0
        else None
    )

    step = (
        _apply_resume(*resumed, cfg, model, optimizer, scaler, global_batch, steps_per_epoch)
        if resumed
        else 0
    )
    total_steps = min(t.max_steps or math.inf, schedule.total_steps)
    log.info(
        "%s, %d classes, %.1fM params | %s",
        cfg.model.arch,
        data.num_classes,
        sum(p.numel() for p in model.parameters()) / 1e6,
        data.description,
    )
    log.info(
        "device %s, amp %s, step %s%s, strategy %s | global batch %d (%d per GPU x %d GPU(s) "
        "x %d accum) | peak LR %.4g | %d steps per epoch, %d steps from step %d",
        dist.device,
        t.amp,
        train_step.description,
        f" (Triton kernels: {t.triton_kernels})" if kernels else "",
        ddp_description(t, dist) if t.strategy == "ddp" else t.strategy,
        global_batch,
        t.batch_size,
        gpus,
        t.accum_steps,
        schedule.peak_lr,
        steps_per_epoch,
        total_steps,
        step,
    )

    # ---- loop --------------------------------------------------------------------------------
    timer = StepTimer(dist.device)  # each step's GPU time, read with its log interval
    metrics = Metrics(
        run_dir,
        is_main=dist.is_main,
        total_steps=int(total_steps),
        start_step=step,
        world_size=gpus,
        device=dist.device,
        sync=r.log_sync,
        timer=timer,
    )
    meter = DeviceMeter(dist.device, dist)
    profiler = RunProfiler(r, run_dir, dist)
    summary: dict[str, Any] = {"global_batch": global_batch, "steps_per_epoch": steps_per_epoch}
    last_eval: dict[str, float] | None = None
    eval_step = saved_step = bn_averaged_step = -1
    first_step = True

    def agree_on_bn_statistics(step: int) -> None:
        """Average BN statistics over ranks, once per step reached (eval and the epoch's
        checkpoint both want it)."""
        nonlocal bn_averaged_step
        if bn_averaged_step != step:
            average_bn_statistics(model, dist)
            bn_averaged_step = step

    def save(step: int, loader_state: bool = True) -> None:
        """``loader_state=False``: the loader has run past ``step`` (an OOM mid-step); the
        resumed run then restarts the reader within the epoch instead."""
        nonlocal saved_step
        check(metrics.settle(), step)  # a non-finite interval in flight is never saved
        if saved_step != step:
            agree_on_bn_statistics(step)  # one model on every rank, before it is saved
            loader_states = dist.all_gather_object(  # DALI's reader states, one per rank
                data.train.state_dict() if loader_state else {},
                what="the all_gather of loader states for a checkpoint",
            )
            if dist.is_main:
                _save(
                    run_dir,
                    cfg,
                    model,
                    optimizer,
                    scaler,
                    loader_states,
                    step,
                    steps_per_epoch,
                    global_batch,
                )
            # nobody runs ahead of a checkpoint that may be the one resumed
            dist.barrier("the barrier after a checkpoint")
        saved_step = step
        metrics.restart_interval()

    last_finite: dict[str, float] = {}
    logged_step = step

    def check(logged: list[Logged], now: int) -> bool:
        """What to do about a non-finite loss in the intervals just read; whether the ranks
        asked to stop in them."""
        nonlocal logged_step
        for entry in logged:
            record = entry.record
            if record["nonfinite_losses"] == 0:
                last_finite.update(step=record["step"], loss=record["loss"])
            else:
                _on_nonfinite(
                    t.on_nan,
                    record,
                    logged_step,
                    now,
                    last_finite,
                    run_dir,
                    cfg,
                    dist,
                    model,
                    optimizer,
                    scaler,
                )
                dropped = metrics.discard_pending()  # trained on the weights just replaced
                if dropped is not None:
                    log.info("metrics of the steps up to %d dropped: restored weights", dropped)
            logged_step = record["step"]
        return any(entry.stop for entry in logged)

    def log_interval(step: int, epoch: int, lr: float) -> bool:
        """The log step: the metrics (an interval late, unless --log-sync), and what to do
        about a non-finite loss; whether the ranks agreed to stop."""
        return check(metrics.log_train(step, epoch, meter, lr, stop=stop.requested), step)

    def evaluate(step: int, epoch: int) -> None:
        nonlocal last_eval, eval_step
        agree_on_bn_statistics(step)
        with span("fasttrain.eval"):
            last_eval, eval_step = evaluator(data.val), step
        metrics.log_eval(step, epoch, last_eval)
        metrics.restart_interval()

    stop = StopRequest()  # SIGTERM / SIGINT: checkpoint, then exit 0
    stop.install()
    stopped = False
    profiler.start()
    try:
        while step < total_steps:
            epoch, in_epoch = divmod(step, steps_per_epoch)
            data.train.set_epoch(epoch, in_epoch * t.accum_steps)
            batches_iter = iter(data.train)
            for _ in range(in_epoch, steps_per_epoch):
                t_wait = time.perf_counter()
                with span("fasttrain.data"):
                    batches = [next(batches_iter) for _ in range(t.accum_steps)]
                data_wait = time.perf_counter() - t_wait
                lr = schedule.lr_at(step)  # for the log; the step sets (or computes) its own
                t_step = time.perf_counter()
                with (
                    dist.collective("the training step (DDP's gradient all_reduce)"),
                    timer.step(),
                    span("fasttrain.step"),
                ):
                    train_step(batches, meter, step)
                profiler.step()
                step += 1
                metrics.step_done(global_batch, data_wait)
                if first_step:  # a one-off sync, to report start-up cost; not the steady state
                    first_step = False
                    _sync(dist.device)
                    now = time.perf_counter()
                    summary["time_to_first_step_s"] = now - t_start
                    summary["first_step_s"] = now - t_step  # compile and autotuning, if any
                    log.info(
                        "first step done %.1f s after start; the step itself took %.1f s "
                        "(compile and autotuning, if any)",
                        summary["time_to_first_step_s"],
                        summary["first_step_s"],
                    )
                    metrics.restart_interval()
                agreed = step % r.log_every == 0 and log_interval(step, epoch, lr)
                if r.ckpt_every_steps and step % r.ckpt_every_steps == 0:
                    save(step)
                # one process stops after this step; several when a log step reads a request
                # from any of them (it travels with the metrics' all-reduce)
                stopped = stop.requested if not dist.distributed else agreed
                if stopped or step >= total_steps:
                    break
            if stopped:
                break
            if meter.samples and log_interval(step, epoch, lr):
                stopped = True  # the ranks agreed at the epoch's last log step
            if step % steps_per_epoch == 0:  # the epoch is complete
                if evaluator is not None and (epoch + 1) % r.eval_every == 0 and not stopped:
                    evaluate(step, epoch)
                save(step)
            if stopped:
                break
        if evaluator is not None and eval_step != step and not stopped:
            evaluate(step, step // steps_per_epoch)
        save(step)
        if stopped:
            summary["stopped_by"] = signal.Signals(stop.signum or signal.SIGTERM).name
            log.warning(
                "stopped by %s at step %d; checkpoint saved in %s: the same command with "
                "--resume auto continues from it",
                summary["stopped_by"],
                step,
                run_dir,
            )
    except torch.cuda.OutOfMemoryError:
        kept = _checkpoint_after_oom(save, step, saved_step, meter, metrics, dist)
        raise OutOfMemory(
            f"out of GPU memory at --batch-size {t.batch_size} ({cfg.model.arch}, "
            f"{cfg.data.image_size} px, amp {t.amp}): lower --batch-size, and raise --accum-steps "
            f"to keep the same global batch; {kept}"
        ) from None
    finally:
        stop.uninstall()
        try:  # after a fault: the interval in flight, if it has landed
            metrics.settle(only_if_landed=True)
        except Exception as e:  # the fault being raised is the one to report
            log.debug("the last log interval could not be read: %s", e)
        profiler.stop()
        if profiler.enabled:
            summary["profile"] = _report_profile(profiler, metrics, step, dist)
        metrics.close()

    # peak memory of every GPU: DataParallel's replicas here, and every DDP rank's own
    on = range(torch.cuda.device_count()) if t.strategy == "dp" else [dist.device.index or 0]
    mine = [peak_memory_gib(torch.device("cuda", i)) for i in on] if t.device == "cuda" else []
    per_gpu = dist.all_gather_object(mine, "the peak memory per GPU")
    summary.update(
        {
            "steps": step,
            "img_per_s": metrics.steady_rate(),
            "img_per_s_per_gpu": (metrics.steady_rate() or 0.0) / gpus,
            "gpus": gpus,
            "peak_mem_gib": peak_memory_gib(dist.device),
            "peak_mem_gib_per_gpu": [p for peaks in per_gpu for p in peaks],
            "wall_s": time.perf_counter() - t_start,
            "capture_s": getattr(train_step, "capture_s", None),
            "val": last_eval,
        }
    )
    if dist.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        rate = summary["img_per_s"]
        log.info(
            "done: %d steps in %.0f s | steady %s img/s | first step after %.1f s | peak "
            "memory %.2f GiB%s | %s",
            step,
            summary["wall_s"],
            f"{rate:,.0f}" if rate else "n/a (too few log intervals)",
            summary.get("time_to_first_step_s", float("nan")),
            summary["peak_mem_gib"],
            f" | val top1 {last_eval['top1']:.2f}%" if last_eval else "",
            run_dir,
        )
    return summary


def _report_profile(profiler: RunProfiler, metrics: Metrics, step: int, dist: DistState):
    """This rank's breakdown of each trace: logged as a table, saved as JSON, and written to
    TensorBoard (main process) as ``profile/<part>_ms``."""
    from dataclasses import asdict

    from fasttrain.breakdown import StepTimes, after_first, mean, summarize, table

    summaries = [summarize(p) for p in profiler.traces()]  # each trace read once
    for s in summaries:
        log.info("%s", table(s))
    overall = mean([StepTimes(**st) for s in summaries for st in after_first(s["steps"])])
    out = {"traces": summaries, "mean_ms": asdict(overall) if overall else None}
    path = profiler.trace_dir / f"breakdown-rank{dist.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    if overall is not None:
        metrics.log_profile(step, asdict(overall))
    return {"breakdown": str(path), "mean_ms": out["mean_ms"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _save(
    run_dir, cfg, model, optimizer, scaler, loader_states, step, steps_per_epoch, global_batch
) -> None:
    epoch, in_epoch = divmod(step, steps_per_epoch)
    accum = cfg.train.accum_steps
    state = {
        "model": model.state_dict(),  # the raw module: no _orig_mod. or module. prefixes
        "optimizer": _optimizer_state(optimizer),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": step,
        "epoch": epoch,
        "loader": {
            "epoch": epoch,
            "start_batch": in_epoch * accum,
            "steps_per_epoch": steps_per_epoch,
        },
        "loader_state": loader_states,  # one per rank: DALI's reader state; empty for the others
        "world_size": len(loader_states),
        "global_batch": global_batch,
        "rng": ckpt.rng_state(),
        "config": cfg.to_dict(),
    }
    try:
        path = ckpt.save_checkpoint(state, run_dir, step, cfg.run.keep_checkpoints)
    except OSError as e:  # a full disk, a lost mount: loud, and the previous one is intact
        previous = ckpt.list_checkpoints(run_dir)
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {step} in {run_dir} ({e.strerror or e}); "
            + (f"{previous[0].name} is intact" if previous else "no earlier checkpoint exists")
            + ": free space or point --output-dir elsewhere, then --resume auto"
        ) from None
    log.debug("saved %s", path)


def _checkpoint_after_oom(
    save, step: int, saved_step: int, meter: DeviceMeter, metrics: Metrics, dist
) -> str:
    """After an OOM the weights are those of the last completed step (the failed step never
    reached the optimizer), so they are saved, in one process; what happened, in words."""
    if dist.distributed:
        return "no checkpoint written (the other ranks wait in a collective; see --dist-timeout)"
    if step == 0 or step == saved_step:
        return "nothing new to checkpoint"
    if dist.device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        # a non-finite loss in the interval in flight or since the last log step: keep out
        in_flight = any(e.record["nonfinite_losses"] for e in metrics.settle())
        if in_flight or meter.sums[2].item() > 0:
            return "no checkpoint written (the loss was not finite)"
        save(step, loader_state=False)
    except Exception as e:
        return f"the checkpoint of step {step} could not be written either ({type(e).__name__})"
    return f"saved a checkpoint of step {step}: --resume auto continues from it"


def _on_nonfinite(
    policy, record, since, now, last_finite, run_dir, cfg, dist, model, optimizer, scaler
) -> None:
    """``--on-nan stop``: a diagnostic file and exit 3, without checkpointing the bad weights.
    ``--on-nan skip``: restore the newest checkpoint in place (the CUDA graph keeps reading the
    same tensors) and go on from the current step; the steps since that checkpoint are lost."""
    diagnostic = {
        "nonfinite_losses": record["nonfinite_losses"],
        "between_steps": [since, record["step"]],
        "lr": record["lr"],
        "last_finite_loss": last_finite.get("loss"),
        "last_finite_loss_step": last_finite.get("step"),
        "on_nan": policy,
    }
    found = ckpt.latest_valid(cfg.run.output_dir) if policy == "skip" else None
    if found is None:
        if dist.is_main:
            (run_dir / "nonfinite.json").write_text(json.dumps(diagnostic, indent=2) + "\n")
        raise NonFiniteLoss(
            f"the loss became NaN or infinite between steps {since} and {record['step']} "
            f"(LR {record['lr']:.4g}; last finite loss {last_finite.get('loss')}); wrote "
            f"{run_dir / 'nonfinite.json'}"
            + (" (no checkpoint to restore for --on-nan skip)" if policy == "skip" else "")
            + "; lower --lr or --warmup-epochs up, check the data, or use --on-nan skip"
        )
    path, state = found
    model.load_state_dict(state["model"])  # copies into the same tensors
    _load_optimizer_in_place(optimizer, state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    log.warning(
        "non-finite loss between steps %d and %d: restored the weights and optimizer of %s "
        "(step %d) and training on from step %d (--on-nan skip)",
        since,
        record["step"],
        path,
        state["step"],
        now,
    )


def _load_optimizer_in_place(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Copy saved momentum into the optimizer's own buffers (a CUDA graph holds them)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        old = saved["state"].get(i, {}).get("momentum_buffer")
        if buf is not None and old is not None:
            buf.copy_(old)
        elif old is not None:
            optimizer.state[p]["momentum_buffer"] = old.to(p.device).clone()


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state with the LR as a float: the graphed step keeps it in a device
    tensor, and a checkpoint should resume the same under any step."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:  # state_dict() copies each group: the optimizer keeps its
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


def _find_resume(cfg: Config) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint ``--resume`` names (or the newest valid one, for 'auto'), loaded."""
    if cfg.run.resume is None:
        return None
    if cfg.run.resume == "auto":
        found = ckpt.latest_valid(cfg.run.output_dir)
        if found is None:
            log.info(
                "--resume auto: no checkpoint in %s yet; starting from scratch", cfg.run.output_dir
            )
        return found
    return cfg.run.resume, ckpt.load_checkpoint(cfg.run.resume)


def _loader_state(state: dict[str, Any], dist: DistState) -> dict | None:
    """This rank's loader state from a checkpoint, if it was saved at the same world size."""
    states = state.get("loader_state")
    if isinstance(states, dict):  # a checkpoint from before per-rank states
        states = [states]
    if not states or len(states) != dist.world_size:
        return None
    return states[dist.rank] or None


def _apply_resume(
    path, state, cfg: Config, model, optimizer, scaler, global_batch: int, steps_per_epoch: int
) -> int:
    """Load model, optimizer, scaler and RNG states; return the step to continue from.

    At another global batch (another world size), the step is converted through the images
    seen: the same epoch, and as far into it as the saved run had trained (rounded down)."""
    _warn_config_changes(state["config"], cfg.to_dict())
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    ckpt.set_rng_state(state["rng"])
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


def _warn_config_changes(old: dict, new: dict) -> None:
    """A resume with other training settings is allowed, but not silently."""
    ignore = {"run", "data.workers", "train.max_steps"}
    changed = [
        f"{s}.{k}: {v!r} -> {new[s][k]!r}"
        for s, body in old.items()
        if s not in ignore
        for k, v in body.items()
        if f"{s}.{k}" not in ignore and new[s].get(k) != v
    ]
    if changed:
        log.warning(
            "resuming with settings that differ from the checkpoint's: %s", "; ".join(changed)
        )
