"""cuDNN's convolutions run once ahead of the first step, on a thread, beside the set-up and
the step's compile.

With ``cudnn.benchmark`` the first call of each convolution shape times cuDNN's candidate
algorithms, and on a machine that has not run them before the CUDA driver first compiles some
of those candidates' kernels from PTX for its GPU (its JIT; the results are kept per machine, in
``~/.nv/ComputeCache`` or ``$CUDA_CACHE_PATH``). For ResNet-50 that is seconds of a fresh
machine's first step (BENCHMARKS.md, start-up), spent one convolution at a time inside the
step, after the compile; a warm start on a new machine (another node sharing the compile cache,
a resume elsewhere) pays it too, though it compiles nothing.

The shapes are known once the model is built: a forward of the model on fake tensors
(``FakeTensorMode``: no memory, no kernels, nothing of the model changed) records each
convolution, torch's and fasttrain's fused ``conv_bn``. A thread runs each one's forward
(torch's) and backward (``convolution_backward``, as the compiled backward calls it) once on
random data of those shapes and layouts, on a stream of its own:

- where CUDA's JIT cache is empty (``jit_cache_empty``: a new machine), from the model's build
  on, beside the rest of the set-up (the optimizer, dynamo's saved trace loaded, the resume)
  and any compile;
- elsewhere only beside a compile, from dynamo's start of it: with the kernels compiled, the
  thread's own cost (its fake forward competes for the interpreter with the set-up) is more
  than a warm start's first step saves, so a start that compiles nothing runs none.

It is joined before the step's own kernels run, so that they, and inductor's timing of them,
never share the GPU with it: at dynamo's end of a compile, or before the first step where the
step compiles nothing (dynamo's trace loaded). The first step then finds the kernels compiled
and, where its calls match, cuDNN's choices made (torch keeps them per process). Training
computes nothing differently: cuDNN benchmarks the same candidates, earlier. Anything that
fails here only leaves the work to the first step. ``FASTTRAIN_CONV_WARMUP=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("fasttrain")
NOTHING_COMPILED = "nothing compiled, and CUDA's JIT cache holds kernels"


@dataclass(frozen=True)
class Spec:
    """A tensor's shape, strides (its layout) and dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor, dtype: torch.dtype | None = None) -> Spec:
        return cls(tuple(t.shape), tuple(t.stride()), dtype or t.dtype)

    def random(self, device: torch.device) -> torch.Tensor:
        return torch.empty_strided(
            self.shape, self.stride, dtype=self.dtype, device=device
        ).normal_()


@dataclass(frozen=True)
class Conv:
    """One convolution of the forward, with what its backward computes."""

    x: Spec
    weight: Spec
    y: Spec
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    input_grad: bool
    bias: bool
    fused: bool  # fasttrain's conv_bn: its forward is fasttrain's cuDNN graph, not torch's

    def run(self, device: torch.device) -> None:
        """This convolution's forward (torch's) and backward on random data."""
        x, w = self.x.random(device), self.weight.random(device)
        common = (self.stride, self.padding, self.dilation, False, [0] * len(self.stride))
        if not self.fused:
            b = (
                torch.zeros(self.weight.shape[0], dtype=w.dtype, device=device)
                if self.bias
                else None
            )
            torch.ops.aten.convolution.default(x, w, b, *common, self.groups)
        g = self.y.random(device)
        bias_sizes = [self.weight.shape[0]] if self.bias else None
        mask = [self.input_grad, True, self.bias]
        torch.ops.aten.convolution_backward.default(g, x, w, bias_sizes, *common, self.groups, mask)


class Recorder(TorchDispatchMode):
    """Records every convolution it sees, in order, once per distinct call."""

    def __init__(self) -> None:
        super().__init__()
        self.convs: list[Conv] = []
        self.conv_bn = _conv_bn()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        conv = None
        if func is torch.ops.aten.convolution.default and not args[6]:  # not transposed
            x, w, bias, stride, padding, dilation, _, _, groups = args
            conv = Conv(
                Spec.of(x), Spec.of(w), Spec.of(out), tuple(stride), tuple(padding),
                tuple(dilation), groups, x.requires_grad, bias is not None, fused=False,
            )  # fmt: skip
        elif func is self.conv_bn:
            x, w, scale, _, stride, padding = args
            conv = Conv(
                Spec.of(x), Spec.of(w, x.dtype), Spec.of(out[0]), (stride, stride),
                (padding, padding), (1, 1), 1, x.requires_grad or scale is not None, False,
                fused=True,
            )  # fmt: skip
        if conv is not None and conv not in self.convs:
            self.convs.append(conv)
        return out


def _conv_bn():
    """fasttrain's fused conv_bn op (imported here: its module needs torch's library)."""
    from fasttrain.model.ops import conv_bn  # noqa: F401  (registers the op)

    return torch.ops.fasttrain.conv_bn.default


def record(
    model: nn.Module, amp_dtype: torch.dtype | None, example: Spec, device: torch.device
) -> list[Conv]:
    """The distinct convolutions ``model``'s forward (autocast to ``amp_dtype``, as the step
    runs it) makes of an input like ``example``: a forward of a fake copy of the model on fake
    tensors, which changes nothing of ``model`` (not even a BN's count of batches)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        # the module copied, each of its tensors a fake of it: no memory, and whatever the
        # forward updates in place (a BN's statistics) is the fake's
        memo = {id(t): mode.from_tensor(t) for t in (*model.parameters(), *model.buffers())}
        fake = copy.deepcopy(model, memo)
        images = torch.empty_strided(
            example.shape, example.stride, dtype=example.dtype, device=device
        )
        with (
            recorder,
            torch.autocast(
                device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None
            ),
        ):
            fake(images)
    return recorder.convs


class ConvWarmup:
    """The thread (module notes); ``wait`` joins it: dynamo's end of compile calls it, and
    ``before_first_step`` where nothing compiles. ``at_once``: the convolutions run from the
    thread's start; otherwise from dynamo's start of a compile."""

    def __init__(
        self,
        model: nn.Module,
        amp_dtype: torch.dtype | None,
        example: Spec,
        device: torch.device,
        at_once: bool = True,
    ):
        self.device = device
        self.go = threading.Event()  # the convolutions may run
        if at_once:
            self.go.set()
        self.skip = False  # nothing compiles: the thread ends without running any
        self.convs: list[Conv] = []
        self.seconds: float | None = None
        self.failed: str | None = None
        self.logged = False
        self.thread = threading.Thread(
            target=self._run,
            args=(model, amp_dtype, example),
            name="fasttrain-conv-warmup",
            daemon=True,
        )

    def _run(self, model: nn.Module, amp_dtype: torch.dtype | None, example: Spec) -> None:
        self.go.wait()
        t0 = time.perf_counter()
        try:
            if self.skip:
                self.failed = NOTHING_COMPILED
                return
            self.convs = record(model, amp_dtype, example, self.device)
            cuda = self.device.type == "cuda"
            stream = torch.cuda.Stream(self.device) if cuda else None
            on_device = torch.cuda.device(self.device) if cuda else contextlib.nullcontext()
            with on_device, torch.cuda.stream(stream):
                with torch.no_grad():
                    for conv in self.convs:
                        conv.run(self.device)
                if cuda:
                    stream.synchronize()
                    torch.cuda.empty_cache()  # its blocks belong to its stream: give them back
        except Exception as e:  # an optimization only: the first step does the work instead
            self.failed = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.perf_counter() - t0

    def start(self) -> ConvWarmup:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._compiling)
        callback_handler.register_end_callback(self._compiled)
        self.thread.start()
        return self

    def before_first_step(self) -> None:
        """The first step is next: where it compiles nothing (dynamo loaded its saved trace),
        its kernels run at once, so the thread is joined now (one still waiting for a compile
        ends without running any); otherwise it runs on beside the compile, and the compile's
        end joins it."""
        if trace_loaded():
            if not self.go.is_set():
                self.skip = True
                self.go.set()
            self.wait()

    def _compiling(self, args: object) -> None:
        """Dynamo's start of a compile: the convolutions may run beside it."""
        from torch._dynamo.callback import callback_handler

        self.go.set()
        callback_handler.remove_start_callback(self._compiling)

    def _compiled(self, args: object) -> None:
        """Dynamo's end of a compile: the compiled code runs next."""
        from torch._dynamo.callback import callback_handler

        self.wait()
        callback_handler.remove_end_callback(self._compiled)

    def wait(self, timeout: float = 300.0) -> None:
        """Until the thread is done (at most ``timeout`` seconds); logs what it did, once."""
        if self.thread.ident is None:
            return  # never started
        self.thread.join(timeout)
        if self.seconds is not None and not self.logged:
            self.logged = True
            if self.failed:  # the first step does the work instead
                level = logging.DEBUG if self.failed == NOTHING_COMPILED else logging.INFO
                log.log(level, "cuDNN's convolutions ahead of the first step: not run (%s)",
                        self.failed)  # fmt: skip
            else:
                log.info(
                    "cuDNN's convolutions ahead of the first step: %d ran in %.1f s, beside the "
                    "set-up and the compile",
                    len(self.convs),
                    self.seconds,
                )


def jit_cache_empty(env: Mapping[str, str]) -> bool:
    """Whether CUDA's JIT cache (``$CUDA_CACHE_PATH``, else ``~/.nv/ComputeCache``) is missing,
    empty or turned off (``CUDA_CACHE_DISABLE=1``): a machine whose driver has compiled none of
    cuDNN's kernels for this GPU yet. One that holds other programs' kernels counts as full."""
    path = jit_cache_path(env)
    if path is None:
        return True
    try:
        return not any(path.iterdir())
    except OSError:  # not there yet
        return True


def jit_cache_path(env: Mapping[str, str]) -> Path | None:
    """Where CUDA's JIT cache is (``$CUDA_CACHE_PATH``, else ``~/.nv/ComputeCache``); None where
    it is turned off (``CUDA_CACHE_DISABLE=1``)."""
    if env.get("CUDA_CACHE_DISABLE") == "1":
        return None
    return Path(env.get("CUDA_CACHE_PATH") or Path.home() / ".nv" / "ComputeCache").expanduser()


def trace_loaded() -> bool:
    """Whether dynamo loaded a saved trace in this process (torch's caching precompile): the
    step it belongs to compiles nothing at its first call."""
    from torch._dynamo.utils import counters

    return counters["dynamo_cache"].get("dynamo_cache_hit", 0) > 0


def start_conv_warmup(
    model: nn.Module,
    amp_dtype: torch.dtype | None,
    batch_shape: tuple[int, int, int, int],
    channels_last: bool,
    env: Mapping[str, str],
    fresh_jit_cache: bool | None = None,
) -> ConvWarmup | None:
    """Start the thread where it helps: a CUDA model, ``cudnn.benchmark`` on, a compiled step
    (the caller's to say), not turned off. None otherwise. ``batch_shape``: the first step's
    input; ``channels_last``: the model's and its input's layout (``--channels-last``);
    ``fresh_jit_cache``: ``jit_cache_empty`` as the process found it at its start (None: asked
    now). By the model's build the process's own CUDA work (CUDA's start, cuDNN's probe) can
    have put kernels into an empty cache, and a new machine would count as an old one."""
    param = next(model.parameters())
    if (
        env.get("FASTTRAIN_CONV_WARMUP", "1") == "0"
        or param.device.type != "cuda"
        or not torch.backends.cudnn.benchmark
    ):
        return None
    try:
        from torch._dynamo.callback import callback_handler  # noqa: F401
    except ImportError:  # no end-of-compile callback to wait in: the thread could overlap
        return None
    layout = torch.empty(
        batch_shape,
        device="meta",
        memory_format=torch.channels_last if channels_last else torch.contiguous_format,
    )
    example = Spec(tuple(batch_shape), tuple(layout.stride()), amp_dtype or param.dtype)
    at_once = jit_cache_empty(env) if fresh_jit_cache is None else fresh_jit_cache
    return ConvWarmup(model, amp_dtype, example, param.device, at_once).start()
