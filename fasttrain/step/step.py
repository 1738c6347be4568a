"""TrainStep: one optimizer step over ``accum_steps`` micro-batches, with one interface.

- ``EagerStep``: the simple reference.
- ``CompiledStep``: the same step with forward + loss compiled by ``torch.compile`` (the backward is
  compiled through AOTAutograd). Tests hold it to the eager step.
- ``GraphedStep`` (``--cuda-graphs``): the whole steady-state step of either of them, captured once
  in a CUDA graph and replayed: forward, loss, backward, optimizer, the LR from a device step
  counter, and the metric accumulators. Tests hold it to the eager step on the GPU.

Nothing here reads a device value on the host: loss and accuracy go into device accumulators
(``metrics.DeviceMeter``) that are read only at log steps. fp16's GradScaler hands the fused
optimizer its inf check as a device tensor, so it needs no host read either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fasttrain.metrics.meter import DeviceMeter
from fasttrain.metrics.profiling import span
from fasttrain.step.ema import ModelEma
from fasttrain.step.erase import Eraser
from fasttrain.step.graphs import blame, capture, on_side_stream
from fasttrain.step.inductor_setup import compile_function
from fasttrain.step.mix import Mixer
from fasttrain.step.optim import InPlaceGradients, Schedule, set_lr

log = logging.getLogger("fasttrain")
Batch = tuple[torch.Tensor, torch.Tensor]
# ordinary steps before capture: enough for compile, cuDNN autotuning and lazy state; DDP
# rebuilds its buckets after its first steps, so it wants 11 (PyTorch CUDA notes)
GRAPH_WARMUP = 3
GRAPH_WARMUP_DDP = 11


class TrainStep(Protocol):
    """One optimizer step over ``accum_steps`` micro-batches: ``step(batches, meter, index)``."""

    description: str  # for the run's log: eager, compiled, + CUDA graph
    capture_s: float | None  # how long the CUDA-graph capture took; None if nothing was captured
    capture_failed: bool  # a capture was tried and failed: the step runs ungraphed

    def __call__(self, batches: Sequence[Batch], meter: DeviceMeter, step: int) -> None: ...

    def recapture(self) -> None:
        """Capture the step again at the next call, with the kernels as they are then."""


class EagerStep:
    """The reference step; ``__call__(batches, meter, step)`` trains one optimizer step."""

    description = "eager"
    capture_s: float | None = None
    capture_failed = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module,
        amp_dtype: torch.dtype | None,
        scaler: torch.amp.GradScaler | None,
        schedule: Schedule,
        clip_grad_norm: float | None = None,
        ema: ModelEma | None = None,
        mixer: Mixer | None = None,
        eraser: Eraser | None = None,
    ):
        self.model = model
        self.eraser = eraser
        self.clip_grad_norm = clip_grad_norm
        self.ema = ema
        self.mixer = mixer
        self.optimizer = optimizer
        self.criterion = criterion
        self.amp_dtype = amp_dtype
        self.scaler = scaler
        self.schedule = schedule
        self.input_dtype = amp_dtype or next(model.parameters()).dtype
        self.device_type = next(model.parameters()).device.type
        self.forward = self._forward

    def recapture(self) -> None:
        """Nothing is captured: each call runs the kernels as they are."""

    def generators(self) -> list[torch.Generator]:
        """The step's own random generators besides torch's default ones (the batch
        augmentations'): a CUDA graph must register them, a checkpoint keep them."""
        return [a.generator for a in (self.eraser, self.mixer) if a is not None]

    @property
    def grads_in_place(self) -> bool:
        """The optimizer's gradients live in buffers it owns: zeroed, never set to None."""
        return isinstance(self.optimizer, InPlaceGradients)

    def _forward(
        self, images: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, correct): the loss against ``targets`` (mixup's soft targets) where given,
        else ``labels``; correct counts the labels the logits' argmax hits."""
        # loaders may hand over another float type (DALI's fp16 buffers): cast here, where a
        # compiled or graphed step folds it into the step instead of a separate pass
        if images.dtype != self.input_dtype:
            images = images.to(self.input_dtype)
        with torch.autocast(
            self.device_type,
            dtype=self.amp_dtype or torch.float32,
            enabled=self.amp_dtype is not None,
        ):
            logits = self.model(images)
            loss = self.criterion(logits, labels if targets is None else targets)
        correct = (logits.argmax(dim=1) == labels).sum()
        return loss, correct

    def _backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _optimizer_step(self, meter: DeviceMeter) -> None:
        if self.clip_grad_norm is not None:
            self._clip_gradients(self.clip_grad_norm)
        if self.scaler is not None:
            # GradScaler keeps its scale on the device (``_scale``: no public accessor reads it
            # without a host sync); the meter counts the updates it skips from its course
            before = self.scaler._scale.clone()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            meter.add_update(before, self.scaler._scale)
        else:
            self.optimizer.step()

    def _clip_gradients(self, max_norm: float) -> None:
        """Scale the gradients so their total L2 norm is at most ``max_norm``: device ops only
        (the norm is never read on the host), so a graph captures it. fp16's scaled gradients
        are unscaled first; GradScaler then tells the optimizer they are."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, max_norm, foreach=True)

    def _micro_steps(self, batches: Sequence[Batch], meter: DeviceMeter) -> None:
        """Forward and backward of every micro-batch, gradients summed; metrics on the device."""
        for images, labels in batches:
            if self.eraser is not None:  # per image, then mixing per batch, as torchvision's
                images = self.eraser(images)
            if self.mixer is not None:  # device draws: capturable, no host read
                images, targets = self.mixer(images, labels)
                loss, correct = self.forward(images, labels, targets)
            else:
                loss, correct = self.forward(images, labels)
            self._backward(loss / len(batches))
            meter.add_device(loss.detach(), correct, images.shape[0])

    def __call__(self, batches: Sequence[Batch], meter: DeviceMeter, step: int) -> None:
        set_lr(self.optimizer, self.schedule.lr_at(step))  # a host float: no device access
        self._micro_steps(batches, meter)
        with span("fasttrain.optimizer"):
            self._optimizer_step(meter)
            if self.ema is not None:
                self.ema.update(step)
        meter.samples += images_in(batches)
        # set to None: backward then hands over fresh gradients instead of adding into zeroed ones,
        # one kernel fewer per parameter
        self.optimizer.zero_grad(set_to_none=True)


def compile_kwargs(mode: str, options: dict[str, Any]) -> dict[str, Any]:
    """torch.compile's arguments. It takes a mode or options, not both, so a mode with extra
    inductor options becomes the mode's own options plus those."""
    if not options:
        return {} if mode == "default" else {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**list_mode_options(mode), **options}}


class CompiledStep(EagerStep):
    def __init__(self, *args, compile_options: dict[str, Any] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.description = "compiled"
        # dynamic=False: the train loader's shapes never change, so never trace a dynamic graph
        self.forward = compile_function(
            self._forward, compile_options, what="the training step", keep_trace=True
        )


class GraphedStep:
    """The whole step of ``base`` in one CUDA graph, captured after a few ordinary steps.

    - **Warm-up:** the first ``GRAPH_WARMUP`` steps (``GRAPH_WARMUP_DDP`` under DDP) run
      ``base``'s work on a side stream (compile, cuDNN autotuning, lazy state such as momentum
      buffers and, under DDP, the reducer's buckets); they are real training steps. Then the
      next step is captured and replayed.
    - **Inputs:** with ``fixed_inputs`` (the loader refills the same buffers every step: DALI,
      synthetic), the graph reads the loader's own tensors and a replay copies nothing. Otherwise
      the graph reads buffers of its own, and each batch is copied into them (a device copy,
      about 40 us for a 256 x 224 px batch on an H200).
    - **Gradients:** they are None at capture, so the captured backward writes them (it does not
      add into them) at fixed addresses in the graph's memory pool: zeroing is part of the
      graph at no cost. Nothing may run a backward outside the graph afterwards.
    - **LR:** computed in the graph by ``Schedule.lr_tensor`` from a device step counter that
      the graph increments, into the tensor the fused optimizer reads.
    - **A new input shape** (``--progressive-resizing``'s next size) drops the graph and its
      memory pool, warms up at the new shape (compiling it, once per size) and captures again;
      so does ``recapture`` (``--tune-kernels later``'s tuned kernels).
    - **Failure:** if capture fails, the warning names the op that broke it, and training goes on
      with ``base``, ungraphed.
    """

    def __init__(
        self,
        base: EagerStep,
        fixed_inputs: bool = False,
        side_stream: torch.cuda.Stream | None = None,
    ):
        """``side_stream``: the stream to warm up and capture on; DDP built under
        --cuda-graphs brings the one its reducer was built on (``parallel.Wrapped``)."""
        self.base = base
        self.fixed_inputs = fixed_inputs
        self.description = f"{base.description} + CUDA graph"
        ddp = isinstance(base.model, DistributedDataParallel)
        self.warmup = GRAPH_WARMUP_DDP if ddp else GRAPH_WARMUP
        device = next(base.model.parameters()).device
        self.step_t = torch.zeros((), dtype=torch.int64, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[Batch] = []
        self.shapes: tuple | None = None  # the input shapes being warmed up or captured
        self.warmed = 0
        self.capture_failed = False
        self.capture_s: float | None = None
        self.meter: DeviceMeter | None = None
        self.side = side_stream or torch.cuda.Stream(device)

    def _body(self, batches: Sequence[Batch], meter: DeviceMeter) -> None:
        """One step as device work only: what warm-up runs and capture records."""
        self.lr.copy_(self.base.schedule.lr_tensor(self.step_t))
        if self.base.grads_in_place:
            self.base.optimizer.zero_grad()  # flat gradients never go None: zero them in the graph
        self.base._micro_steps(batches, meter)
        self.base._optimizer_step(meter)
        if self.base.ema is not None:  # the average follows in the graph, from the device step
            self.base.ema.update(self.step_t)
        self.step_t += 1

    def __call__(self, batches: Sequence[Batch], meter: DeviceMeter, step: int) -> None:
        if self.capture_failed:
            return self.base(batches, meter, step)
        shapes = tuple(tuple(x.shape) for x, _ in batches)
        if shapes != self.shapes:
            if self.shapes is not None:
                log.info(
                    "--cuda-graphs: the input is now %s (was %s): warming up and capturing the "
                    "step again",
                    "x".join(map(str, shapes[0])),
                    "x".join(map(str, self.shapes[0])),
                )
            self.recapture()
            self.shapes = shapes
        if self.graph is None:
            if self.warmed == 0:  # the optimizer reads its LR from the device from now on
                self.step_t.fill_(step)
                set_lr(self.base.optimizer, self.lr)  # type: ignore[arg-type]
            if self.warmed < self.warmup:
                self._warm_up(batches, meter)
                return
            if not self._capture(batches, meter):
                return self.base(batches, meter, step)
        if meter is not self.meter:
            raise RuntimeError("the graphed step adds into the DeviceMeter it was captured with")
        with span("fasttrain.copy_in"):
            for (x, y), (sx, sy) in zip(batches, self.static, strict=True):
                _into(sx, x)
                _into(sy, y)
        with span("fasttrain.graph_replay"):
            self.graph.replay()
        meter.samples += images_in(batches)

    def recapture(self) -> None:
        """Drop the graph and its memory pool: the next call warms up and captures again, on
        the kernels as they are then (a new input shape; ``late_tuning``'s tuned kernels)."""
        if self.graph is not None:  # its replays left gradients in its pool
            self.base.optimizer.zero_grad(set_to_none=True)
        self.graph, self.static, self.warmed = None, [], 0

    def _warm_up(self, batches: Sequence[Batch], meter: DeviceMeter) -> None:
        def step() -> None:
            self._body(batches, meter)
            self.base.optimizer.zero_grad(set_to_none=True)

        on_side_stream(step, self.side)
        meter.samples += images_in(batches)
        self.warmed += 1

    def _capture(self, batches: Sequence[Batch], meter: DeviceMeter) -> bool:
        """Record one step (it does not run it). False, with a warning, if capture failed."""
        self.base.optimizer.zero_grad(set_to_none=True)
        if self.fixed_inputs:
            self.static = list(batches)
        else:
            self.static = [
                (x.clone(memory_format=torch.preserve_format), y.clone()) for x, y in batches
            ]
        self.meter = meter
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            # the augmentations' generators must advance at every replay
            generators = self.base.generators()
            graph, _ = capture(lambda: self._body(self.static, meter), self.side, generators)
        except Exception as e:  # any failure: report it, then train ungraphed
            self.capture_failed = True
            self.static = []
            self.base.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            log.warning(
                "--cuda-graphs: capturing the training step failed, so it runs without a CUDA "
                "graph (%s). The op that broke capture: %s",
                self.base.description,
                blame(e),
            )
            return False
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.graph = graph
        log.info("captured the training step in a CUDA graph in %.2f s", self.capture_s)
        return True


def images_in(batches: Sequence[Batch]) -> int:
    return sum(images.shape[0] for images, _ in batches)


def _into(static: torch.Tensor, batch: torch.Tensor) -> None:
    """Make ``static`` hold ``batch``: nothing to do when the loader filled it in place."""
    if batch.data_ptr() != static.data_ptr() or batch.stride() != static.stride():
        static.copy_(batch, non_blocking=True)


def build_loss(
    label_smoothing: float, amp: str, xent: bool = False
) -> tuple[nn.Module, torch.amp.GradScaler | None]:
    """The criterion (torch's cross-entropy, or fasttrain's Triton one for ``xent``) and, for
    fp16, the GradScaler: one place, so the trainer and ``--batch-size auto``'s trials agree."""
    if xent:
        from fasttrain.kernels.cross_entropy import CrossEntropy

        criterion: nn.Module = CrossEntropy(label_smoothing=label_smoothing)
    else:
        criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    return criterion, torch.amp.GradScaler("cuda") if amp == "fp16" else None


def build_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None,
    schedule: Schedule,
    compile: bool,
    compile_options: dict[str, Any] | None = None,
    cuda_graphs: bool = False,
    fixed_inputs: bool = False,
    side_stream: torch.cuda.Stream | None = None,
    clip_grad_norm: float | None = None,
    ema: ModelEma | None = None,
    mixer: Mixer | None = None,
    eraser: Eraser | None = None,
) -> EagerStep | GraphedStep:
    """The step the flags ask for. ``fixed_inputs``: the loader refills the same tensors every
    step (``Loader.fixed_buffers``), so a graph can read them in place."""
    args = (
        model, optimizer, criterion, amp_dtype, scaler, schedule, clip_grad_norm, ema, mixer, eraser
    )  # fmt: skip
    base = CompiledStep(*args, compile_options=compile_options) if compile else EagerStep(*args)
    if cuda_graphs:
        return GraphedStep(base, fixed_inputs=fixed_inputs, side_stream=side_stream)
    return base
