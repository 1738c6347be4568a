"""The training loop: epochs of optimizer steps, with log, eval and checkpoint cadences.

``train`` sets the run up (the run directory, then ``setup.set_up``: resume, batch size,
``builder.build``) and hands it to ``Trainer.fit``, the loop. The position in the run is the
optimizer step: epoch and position inside the epoch are derived from it, which is what makes
resume exact.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fasttrain.config import Config
from fasttrain.dist.parallel import average_bn_statistics
from fasttrain.dist.state import DistState
from fasttrain.errors import OutOfMemory, UserError
from fasttrain.metrics.log import Metrics
from fasttrain.metrics.meter import DeviceMeter, StepTimer, peak_memory_gib
from fasttrain.metrics.profiling import RunProfiler, report_profile, span
from fasttrain.metrics.rates import rates_by
from fasttrain.metrics.startup import Heartbeat, Startup, describe
from fasttrain.model.cudnn.graph import selection_seconds
from fasttrain.run import checkpoint as ckpt
from fasttrain.run import resume
from fasttrain.run.build import Built
from fasttrain.run.compile_cache import Artifacts
from fasttrain.run.faults import NonFiniteWatch, StopRequest, checkpoint_after_oom
from fasttrain.run.folder import open_run_folder
from fasttrain.run.setup import set_up, total_steps
from fasttrain.step.late_tuning import LateTuning, tunes_kernels
from fasttrain.step.parallel_tuning import candidates_sent

log = logging.getLogger("fasttrain")


class Trainer:
    """One run's loop and its cadences: log every ``--log-every`` steps, evaluate and checkpoint
    at each epoch's end (and every ``--ckpt-every-steps``), stop when asked."""

    def __init__(
        self,
        cfg: Config,
        dist: DistState,
        built: Built,
        start_step: int,
        startup: Startup,
        artifacts: Artifacts,
    ):
        self.cfg, self.dist, self.built = cfg, dist, built
        self.training = built.training
        self.run_dir = Path(cfg.run.output_dir)
        self.step = self.start_step = start_step
        self.plan = built.plan  # each epoch's steps and global batch
        self.total_steps = total_steps(cfg, self.training)
        self.startup, self.t_start = startup, startup.t_start
        self.cudnn_s = selection_seconds()  # cuDNN's plans timed before the first step
        self.artifacts = artifacts  # saved after the first step and at checkpoints
        self.timer = StepTimer(dist.device)  # each step's GPU time, read with its log interval
        self.metrics = Metrics(
            self.run_dir,
            is_main=dist.is_main,
            total_steps=self.total_steps,
            start_step=start_step,
            world_size=built.gpus,
            device=dist.device,
            timer=self.timer,
        )
        self.meter = DeviceMeter(dist.device, dist)
        self.profiler = RunProfiler(cfg.run, self.run_dir, dist, self.total_steps - start_step)
        self.stop = StopRequest()
        self.nonfinite = NonFiniteWatch(cfg.train.on_nan, self.run_dir, dist, start_step)
        self.summary: dict[str, Any] = {
            "global_batch": built.global_batch,  # the first epoch's
            "steps_per_epoch": built.steps_per_epoch,
        }
        if not self.plan.is_uniform:
            self.summary["plan"] = self.plan.state_dict()
        self.resolution = cfg.typed.resolution
        self.epoch = self.plan.locate(start_step)[0]
        self.size = self.resolution.size_at(self.epoch)
        self.resized: tuple[int, float] | None = None  # a new size's first step and start time
        if self.resolution.progressive:
            self.summary["resizes"] = []
            log.info("--progressive-resizing: %s", self.resolution.describe(cfg.train.epochs))
        self.lr = 0.0  # the LR of the last step, for the log
        self.stopped = False
        self.last_eval: dict[str, float] | None = None
        self.eval_step = self.saved_step = self.bn_averaged_step = -1
        later = cfg.train.tune_kernels == "later" and tunes_kernels(cfg)
        # --tune-kernels later: from here on, kernels train untuned until the loop tunes them
        self.late = LateTuning() if later else None

    def fit(self) -> dict[str, Any]:
        """Train to the end of the run, or until a stop request; returns the run summary."""
        self.stop.install()
        self.profiler.start()
        ended = False  # every rank came out of the loop: they can still exchange a profile
        try:
            while self.step < self.total_steps and not self.stopped:
                self.run_epoch()
            if (
                self.built.evaluator is not None
                and self.eval_step != self.step
                and not self.stopped
            ):
                self.evaluate(self.plan.locate(self.step)[0])
            self.save()
            if self.stopped:
                self.summary["stopped_by"] = self.stop.name
                log.warning(
                    "stopped by %s at step %d; checkpoint saved in %s: the same command with "
                    "--output-dir %s --resume auto continues from it",
                    self.stop.name,
                    self.step,
                    self.run_dir,
                    self.run_dir,
                )
            ended = True
        except torch.cuda.OutOfMemoryError:
            raise self.out_of_memory() from None
        finally:
            self.close(ended)
        return self.finish()

    def run_epoch(self) -> None:
        """The rest of the current epoch, then its evaluation and checkpoint."""
        epoch, in_epoch = self.plan.locate(self.step)
        batch, before = self.plan.global_batch(epoch), self.plan.global_batch(self.epoch)
        self.epoch = epoch
        r = self.cfg.run
        size = self.resolution.size_at(epoch)
        if size != self.size:
            log.info(
                "epoch %d trains on %d px crops (was %d)%s: the loader, the compiled step and "
                "its CUDA graph change to the new size first",
                epoch,
                size,
                self.size,
                f" at global batch {batch} (was {before}), {self.plan.steps_in(epoch)} steps, "
                f"peak LR {self.training.schedule.peak_at(self.step):.4g}"
                if batch != before
                else "",
            )
            self.size = size
            self.resized = (self.step, time.perf_counter())
        for batches, waits in self.batches(epoch, in_epoch):
            self.train_step(batches, *waits)
            agreed = self.step % r.log_every == 0 and self.log(epoch)
            if r.ckpt_every_steps and self.step % r.ckpt_every_steps == 0:
                self.save()
            # one process stops after this step; several when a log step reads a request from
            # any of them (it travels with the metrics' all-reduce)
            self.stopped = agreed if self.dist.distributed else self.stop.requested
            if self.stopped or self.step >= self.total_steps:
                break
        if self.stopped:
            return
        if self.meter.samples and self.log(epoch):
            self.stopped = True  # the ranks agreed at the epoch's last log step
        if self.plan.locate(self.step)[1] == 0:  # the epoch is complete
            every = r.eval_every
            if self.built.evaluator is not None and (epoch + 1) % every == 0 and not self.stopped:
                self.evaluate(epoch)
            self.save()

    def batches(self, epoch: int, in_epoch: int) -> Iterator[tuple[list, tuple[float, float]]]:
        """Each remaining step's micro-batches, with the host's seconds getting them: waiting for
        the loader, and copying them to the device."""
        accum = self.cfg.train.accum_steps
        loader = self.built.data.train
        loader.set_epoch(epoch, in_epoch * accum)
        it = iter(loader)
        for _ in range(in_epoch, self.plan.steps_in(epoch)):
            t0, copied = time.perf_counter(), loader.copy_clock.seconds
            with span("fasttrain.data"):
                batches = [next(it) for _ in range(accum)]
            copy_in = loader.copy_clock.seconds - copied
            yield batches, (time.perf_counter() - t0 - copy_in, copy_in)

    def train_step(self, batches: list, loader_wait: float, copy_in: float) -> None:
        self.lr = self.training.schedule.lr_at(self.step)  # for the log; the step sets its own
        if self.step == self.start_step and self.cfg.train.compile:
            log.info(
                "compiling the step (--compile-mode %s): the first step waits for it, a minute "
                "or more the first time, seconds once inductor has cached it",
                self.cfg.train.compile_mode,
            )
        t_step = time.perf_counter()
        first = self.step == self.start_step and self.dist.is_main
        tuning = self.late is not None and not first and self.late.due()
        if tuning:  # the step and evaluation are captured again after it
            evaluators = (self.built.evaluator, self.built.ema_evaluator)
            graphs = [self.training.step, *(e for e in evaluators if e is not None)]
            self.late.begin(self.step + 1, graphs)
        with (
            Heartbeat("first step", self.t_start) if first else nullcontext(),
            Heartbeat("tuning the kernels", self.t_start) if tuning else nullcontext(),
            self.dist.collective("the training step (DDP's gradient all_reduce)"),
            self.timer.step(),
            span("fasttrain.step"),
        ):
            if self.step == self.start_step and self.built.conv_warmup is not None:
                self.built.conv_warmup.before_first_step()  # none of it beside the step's kernels
            self.training.step(batches, self.meter, self.step)
        self.profiler.step()
        self.step += 1
        self.metrics.step_done(self.plan.global_batch(self.epoch), loader_wait, copy_in)
        if self.step == self.start_step + 1:
            self.first_step_done(t_step)
        elif self.resized is not None and self.step == self.resized[0] + 1:
            self.first_resized_step_done()
        if tuning:
            self.late.done(self.dist.device, t_step)
            self.artifacts.save()  # the tuned configurations, and the kernels that run them
            self.metrics.restart_interval()

    def first_step_done(self, t_step: float) -> None:
        """A one-off sync, to report start-up cost (not the steady state)."""
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
        now = time.perf_counter()
        self.summary["time_to_first_step_s"] = now - self.t_start
        self.summary["first_step_s"] = now - t_step  # compile and autotuning, if any
        cudnn = {"cuDNN plans": selection_seconds() - self.cudnn_s}
        self.summary["startup"] = self.startup.first_step(t_step, cudnn)
        self.summary["startup"]["tuning_candidates_ahead"] = candidates_sent()
        log.info(
            "first step done %.1f s after start; the step itself took %.1f s%s",
            self.summary["time_to_first_step_s"],
            self.summary["first_step_s"],
            " (compiling it, and tuning if on)" if self.cfg.train.compile else "",
        )
        log.info("%s", describe(self.summary["startup"]))
        self.artifacts.save()
        self.metrics.restart_interval()

    def first_resized_step_done(self) -> None:
        """A one-off sync at a new size: what the change cost (the loader's rebuild, a compile
        the first time a size is seen, the step), for the log and summary.json."""
        assert self.resized is not None
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
        seconds = time.perf_counter() - self.resized[1]
        epoch = self.plan.locate(self.resized[0])[0]
        self.summary["resizes"].append({"epoch": epoch, "size": self.size, "first_step_s": seconds})
        log.info(
            "the first step at %d px was done %.1f s after the epoch began", self.size, seconds
        )
        self.resized = None
        self.metrics.restart_interval()

    def log(self, epoch: int) -> bool:
        """A log step: the metrics (an interval late), and what to do about a non-finite loss;
        whether the ranks agreed to stop."""
        logged = self.metrics.log_train(
            self.step, epoch, self.meter, self.lr, stop=self.stop.requested
        )
        return self.nonfinite.check(logged, self.step, self.training, self.metrics)

    def agree_on_bn_statistics(self) -> None:
        """Average BN statistics over ranks, once per step reached (eval and the epoch's
        checkpoint both want it)."""
        if self.bn_averaged_step != self.step:
            average_bn_statistics(self.training.model, self.dist)
            if self.training.ema is not None:  # its buffers are the rank's own model's
                average_bn_statistics(self.training.ema.module, self.dist)
            self.bn_averaged_step = self.step

    def evaluate(self, epoch: int) -> None:
        self.agree_on_bn_statistics()
        with span("fasttrain.eval"):
            self.last_eval = self.built.evaluator(self.built.data.val)
            if self.built.ema_evaluator is not None:  # the average, on the same images
                ema = self.built.ema_evaluator(self.built.data.val)
                self.last_eval.update(ema_top1=ema["top1"], ema_top5=ema["top5"])
        self.eval_step = self.step
        self.metrics.log_eval(self.step, epoch, self.last_eval)
        self.metrics.restart_interval()

    def save(self, loader_state: bool = True) -> None:
        """Checkpoint this step (once). ``loader_state=False``: the loader has run past the step
        (an OOM mid-step); the resumed run then restarts the reader within the epoch."""
        self.nonfinite.check(self.metrics.settle(), self.step, self.training, self.metrics)
        if self.saved_step != self.step:
            self.agree_on_bn_statistics()  # one model on every rank, before it is saved
            # never a checkpoint of a broken model: every rank checks its (identical) state
            if not self.nonfinite.check_state(self.step, self.training):
                self.metrics.restart_interval()
                return
            loader_states = self.dist.all_gather_object(  # DALI's reader states, one per rank
                self.built.data.train.state_dict() if loader_state else {},
                what="the all_gather of loader states for a checkpoint",
            )
            augments = self.training.augments()
            augment_states = (
                self.dist.all_gather_object(
                    {name: a.state_dict() for name, a in augments.items()},
                    what="the all_gather of the augmentations' generator states",
                )
                if augments
                else None
            )
            if self.dist.is_main:
                state = resume.train_state(
                    self.cfg,
                    self.training,
                    loader_states,
                    self.step,
                    self.plan,
                    augment_states,
                )
                log.debug(
                    "saved %s", ckpt.write(state, self.run_dir, self.cfg.run.keep_checkpoints)
                )
                self.artifacts.save()  # what evaluation's model compiled since, if anything
            # nobody runs ahead of a checkpoint that may be the one resumed
            self.dist.barrier("the barrier after a checkpoint")
        self.saved_step = self.step
        self.metrics.restart_interval()

    def out_of_memory(self) -> OutOfMemory:
        kept = checkpoint_after_oom(
            lambda: self.save(loader_state=False),
            self.step,
            self.saved_step,
            self.metrics,
            self.meter.sums,
            self.dist,
        )
        t = self.cfg.train
        own = self.cfg.typed.batch_sizes.get(self.size)  # this size's own batch, if any
        flag = f"--batch-sizes {self.size}:{own}" if own else f"--batch-size {t.batch_size}"
        return OutOfMemory(
            f"out of GPU memory at {flag} ({self.cfg.model.arch}, {self.size} px, amp "
            f"{t.amp}): lower {flag.split()[0]}, and raise --accum-steps to keep the same global "
            f"batch; {kept}"
        )

    def close(self, ended: bool) -> None:
        """After the loop (``ended``), or a fault: the loaders' workers, the last interval (if it
        has landed), the profile (every rank's after the loop, this rank's after a fault)."""
        self.stop.uninstall()
        late = self.late.close() if self.late is not None else None
        if late is not None:  # kernels were put off: when they tuned, or how many wait
            self.summary["late_tuning"] = late
        self.built.data.close()
        try:
            self.metrics.settle(only_if_landed=True)
        except Exception as e:  # the fault being raised is the one to report
            log.debug("the last log interval could not be read: %s", e)
        self.profiler.stop()
        if self.profiler.enabled:
            gather = partial(self.dist.all_gather_object, what="the ranks' profiles")
            self.summary["profile"] = report_profile(
                self.profiler, self.metrics.log_profile, self.step, gather if ended else None
            )
        self.metrics.close()

    def finish(self) -> dict[str, Any]:
        """The run summary: logged, and written to summary.json."""
        t, dist = self.cfg.train, self.dist
        # peak memory of every GPU: DataParallel's replicas here, and every DDP rank's own
        on = range(torch.cuda.device_count()) if t.strategy == "dp" else [dist.device.index or 0]
        mine = [peak_memory_gib(torch.device("cuda", i)) for i in on] if t.device == "cuda" else []
        per_gpu = dist.all_gather_object(mine, "the peak memory per GPU")
        rate = self.metrics.steady_rate()
        self.summary.update(
            {
                "steps": self.step,
                "start_step": self.start_step,  # a resumed run's figures cover its own steps
                "img_per_s": rate,
                "img_per_s_per_gpu": (rate or 0.0) / self.built.gpus,
                "gpus": self.built.gpus,
                "peak_mem_gib": peak_memory_gib(dist.device),
                "peak_mem_gib_per_gpu": [p for peaks in per_gpu for p in peaks],
                "wall_s": time.perf_counter() - self.t_start,
                "capture_s": self.training.step.capture_s,
                "val": self.last_eval,
            }
        )
        if self.cfg.train.compile:  # the whole run's, evaluation's graphs included
            self.summary["fx_graph_cache"] = self.startup.fx_graph_cache()
        if self.resolution.progressive:  # the steady rate of each train size, as its own run
            by_size = rates_by(self.metrics.intervals, self.resolution.size_at)
            self.summary["img_per_s_by_size"] = {str(k): v for k, v in sorted(by_size.items())}
            log.info(
                "img/s by train size: %s",
                ", ".join(f"{k} px {v:,.0f}" for k, v in sorted(by_size.items()) if v),
            )
        if dist.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
            parts = [
                f"steps {self.start_step}-{self.step} in {self.summary['wall_s']:.0f} s"
                if self.start_step
                else f"{self.step} steps in {self.summary['wall_s']:.0f} s",
                f"steady {rate:,.0f} img/s" if rate else "steady img/s: too few log intervals",
            ]
            if "time_to_first_step_s" in self.summary:
                parts.append(f"first step after {self.summary['time_to_first_step_s']:.1f} s")
            if self.summary["peak_mem_gib"] is not None:
                parts.append(f"peak memory {self.summary['peak_mem_gib']:.2f} GiB")
            if self.last_eval:
                parts.append(f"val top1 {self.last_eval['top1']:.2f}%")
            log.info("done: %s | %s", " | ".join(parts), self.run_dir)
            if "startup" in self.summary:
                log.info("%s", describe(self.summary["startup"]))
        self.artifacts.save()
        return self.summary


def train(cfg: Config, dist: DistState, startup: Startup | None = None) -> dict[str, Any]:
    """Set up the run ``cfg`` describes and train it; returns the run summary. ``startup``:
    the time to the first step so far (from the program's start), by part."""
    startup = Startup(time.perf_counter()) if startup is None else startup
    # before the run directory (a finished run changes nothing) and the data (a DALI pipeline
    # restores when it is built)
    resumed = ckpt.find_resume(cfg.run)
    if resumed is not None and resume.finished(resumed[1], cfg):
        step = int(resumed[1]["step"])
        if dist.is_main:
            print(
                f"fasttrain: --resume: {resumed[0]} is the end of this run (step {step}); "
                "nothing to train, nothing changed. Raise --epochs or --max-steps to go on",
                file=sys.stderr,
            )
        return {"steps": step, "complete": True}
    folder = open_run_folder(cfg, dist)  # this run's from here on: its lock is taken
    try:  # until training starts, a bad input leaves no run folder behind
        built, step, artifacts = set_up(cfg, dist, folder.path, resumed, startup)
    except UserError:
        folder.discard(dist)
        raise
    except BaseException:  # a fault: its log stays, the folder is free again
        folder.release()
        raise
    try:
        return Trainer(cfg, dist, built, step, startup, artifacts).fit()
    finally:
        folder.release()
