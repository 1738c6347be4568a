"""cuDNN's convolutions ahead of the first step: the convolutions a forward on fake tensors
records, that running them is valid (torch checks every argument) and touches nothing of the
model, and the thread's life: joined at dynamo's end of compile or before the first step. On
the CPU: cuDNN's side is GPU work, run by every compiled GPU start."""

import threading

import pytest
import torch
import torchvision

from fasttrain.model.fused_resnet import FusedResNet
from fasttrain.step import conv_warmup
from fasttrain.step.conv_warmup import ConvWarmup, Spec, record
from tests.conftest import FAST, start_as_compiled


def nhwc_example(n: int, size: int, dtype=torch.float32) -> Spec:
    layout = torch.empty(n, 3, size, size, device="meta").contiguous(
        memory_format=torch.channels_last
    )
    return Spec((n, 3, size, size), tuple(layout.stride()), dtype)


def test_torchvisions_resnet_convolutions_are_recorded_once_each():
    model = torchvision.models.resnet18().to(memory_format=torch.channels_last)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convs = record(model, None, nhwc_example(2, 64), torch.device("cpu"))
    # the stem, then per stage its first block's two 3x3 and (after the first) its shortcut,
    # and its second block's two 3x3, minus the repeats
    assert convs[0].x.shape == (2, 3, 64, 64) and convs[0].weight.shape == (64, 3, 7, 7)
    assert convs[0].y.shape == (2, 64, 32, 32) and convs[0].stride == (2, 2)
    assert not convs[0].input_grad and all(c.input_grad for c in convs[1:])
    assert len(convs) == len(set(convs)) == 11
    assert all(not c.fused and not c.bias for c in convs)
    assert all(c.x.stride == torch.empty(c.x.shape).to(
        memory_format=torch.channels_last).stride() for c in convs)  # fmt: skip
    for k, v in model.state_dict().items():  # the fake forward changed no running statistic
        assert torch.equal(v, before[k]), k


def test_the_fused_resnets_convolutions_are_its_conv_bn_ops():
    model = FusedResNet("resnet18").to(memory_format=torch.channels_last)
    convs = record(model, None, nhwc_example(2, 64), torch.device("cpu"))
    fused = [c for c in convs if c.fused]
    assert fused and all(c.input_grad for c in fused)
    assert {c.weight.shape for c in fused} >= {(64, 64, 3, 3), (512, 512, 3, 3)}


@pytest.mark.parametrize("arch", ["resnet18", "fused"])
def test_the_recorded_convolutions_run(arch):
    """Each recorded call's forward and backward, with torch checking every argument."""
    model = FusedResNet("resnet18") if arch == "fused" else torchvision.models.resnet18()
    model = model.to(memory_format=torch.channels_last)
    convs = record(model, None, nhwc_example(2, 32), torch.device("cpu"))
    with torch.no_grad():
        for conv in convs:
            conv.run(torch.device("cpu"))


def blocked_warmup(monkeypatch) -> tuple[ConvWarmup, list[str]]:
    """A warm-up whose convolutions hold until something waits for it (its ``wait``): whoever
    does not wait leaves it running."""
    release = threading.Event()
    monkeypatch.setattr(conv_warmup.Conv, "run", lambda self, device: release.wait(10))
    model = torchvision.models.resnet18().to(memory_format=torch.channels_last)
    warmup = ConvWarmup(model, None, nhwc_example(2, 32), torch.device("cpu"))
    waits, join = [], warmup.wait

    def wait(timeout: float = 300.0) -> None:
        waits.append("wait")
        release.set()
        join(timeout)

    monkeypatch.setattr(warmup, "wait", wait)
    return warmup, waits


def test_the_thread_is_waited_for_at_the_end_of_a_compile(monkeypatch):
    from torch._dynamo.callback import callback_handler

    warmup, waits = blocked_warmup(monkeypatch)
    warmup.start()
    assert warmup._compiled in callback_handler.end_callbacks
    assert warmup.thread.is_alive()  # it runs from its start, not from a compile's
    compiled = torch.compile(lambda x: x * 2, backend="eager")
    compiled(torch.ones(2))  # dynamo's end of the compile waits for it
    assert waits and not warmup.thread.is_alive() and warmup.failed is None
    assert len(warmup.convs) == 11 and warmup.seconds > 0
    assert warmup._compiled not in callback_handler.end_callbacks


@pytest.mark.parametrize("loaded", [True, False])
def test_before_the_first_step_it_is_joined_only_where_nothing_compiles(monkeypatch, loaded):
    """With dynamo's trace loaded the step's kernels run at once: joined before it; otherwise
    the thread runs on into the compile, whose end joins it."""
    monkeypatch.setattr(conv_warmup, "trace_loaded", lambda: loaded)
    warmup, waits = blocked_warmup(monkeypatch)
    warmup.thread.start()  # no callbacks: only before_first_step may join it
    warmup.before_first_step()
    assert warmup.thread.is_alive() is not loaded and bool(waits) is loaded
    warmup.wait()
    assert not warmup.thread.is_alive()


def test_with_the_jit_cache_full_it_waits_for_a_compile(monkeypatch):
    from torch._dynamo.callback import callback_handler

    ran = []
    monkeypatch.setattr(conv_warmup.Conv, "run", lambda self, device: ran.append(self))
    model = torchvision.models.resnet18().to(memory_format=torch.channels_last)
    warmup = ConvWarmup(model, None, nhwc_example(2, 32), torch.device("cpu"), at_once=False)
    warmup.start()
    assert not warmup.go.wait(0.3) and ran == []  # nothing before a compile starts
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
    assert not warmup.thread.is_alive() and len(ran) == 11 and warmup.failed is None
    assert warmup._compiling not in callback_handler.start_callbacks


def test_with_the_jit_cache_full_a_start_that_compiles_nothing_runs_none(monkeypatch):
    monkeypatch.setattr(conv_warmup, "trace_loaded", lambda: True)
    ran = []
    monkeypatch.setattr(conv_warmup.Conv, "run", lambda self, device: ran.append(self))
    model = torchvision.models.resnet18().to(memory_format=torch.channels_last)
    warmup = ConvWarmup(model, None, nhwc_example(2, 32), torch.device("cpu"), at_once=False)
    warmup.thread.start()
    warmup.before_first_step()  # dynamo's trace loaded: the thread ends, running nothing
    assert not warmup.thread.is_alive()
    assert warmup.failed == conv_warmup.NOTHING_COMPILED and ran == [] and warmup.convs == []


def test_the_jit_cache_counts_empty_where_missing_empty_or_turned_off(tmp_path):
    empty = conv_warmup.jit_cache_empty
    assert empty({"CUDA_CACHE_PATH": str(tmp_path / "missing")})
    assert empty({"CUDA_CACHE_PATH": str(tmp_path)})
    (tmp_path / "index").write_bytes(b"x")
    assert not empty({"CUDA_CACHE_PATH": str(tmp_path)})
    assert empty({"CUDA_CACHE_PATH": str(tmp_path), "CUDA_CACHE_DISABLE": "1"})


def test_trace_loaded_reads_dynamos_cache_hits(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setitem(counters, "dynamo_cache", type(counters["dynamo_cache"])())
    assert not conv_warmup.trace_loaded()
    counters["dynamo_cache"]["dynamo_cache_hit"] += 1
    assert conv_warmup.trace_loaded()


def test_nothing_starts_off_the_gpu_or_when_turned_off():
    model = torchvision.models.resnet18()
    assert conv_warmup.start_conv_warmup(model, None, (1, 3, 32, 32), True, {}) is None  # the CPU
    assert (
        conv_warmup.start_conv_warmup(
            model, None, (1, 3, 32, 32), True, {"FASTTRAIN_CONV_WARMUP": "0"}
        )
        is None
    )


@pytest.mark.gpu
def test_on_the_gpu_the_convolutions_run_while_a_compile_runs():
    """fp16, channels_last, cudnn.benchmark on, as a compiled training start: the thread records
    the fused model's convolutions, runs them, and is done when the compile ends; the model's
    weights and statistics are untouched."""
    torch.backends.cudnn.benchmark = True
    model = FusedResNet("resnet18").cuda().to(memory_format=torch.channels_last)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    warmup = conv_warmup.start_conv_warmup(model, torch.float16, (8, 3, 64, 64), True, {})
    assert warmup is not None
    compiled = torch.compile(lambda x: x * 2)
    compiled(torch.ones(2, device="cuda"))
    assert not warmup.thread.is_alive() and warmup.failed is None, warmup.failed
    assert warmup.convs and any(c.fused for c in warmup.convs)
    assert all(c.x.dtype == torch.float16 for c in warmup.convs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_run_starts_it_at_the_models_build_and_asks_before_its_first_step_only(
    run, tiny_data, tmp_path, monkeypatch
):
    """The run's wiring, with a stand-in for the thread (the CPU runs none): started once, as
    soon as the model is built (before its step), at the first step's input shape, told that
    CUDA's JIT cache was empty where it was so at the process's start, though something before
    the model's build filled it since (here the settings' resolution, standing in for the
    process's own CUDA work on a GPU); asked before the first step, not after."""
    from fasttrain.run import build as build_module

    events = []
    jit_cache = tmp_path / "jit-cache"  # a new machine's: not there yet
    monkeypatch.setenv("CUDA_CACHE_PATH", str(jit_cache))

    class StandIn:
        def before_first_step(self) -> None:
            events.append("before the first step")

    def start(model, amp_dtype, shape, channels_last, env, fresh_jit_cache):
        assert not conv_warmup.jit_cache_empty(env)  # filled since the start...
        events.append(("started", shape, fresh_jit_cache))  # ...and judged as it was then
        return StandIn()

    def fill_the_jit_cache():
        jit_cache.mkdir()
        (jit_cache / "index").write_bytes(b"a kernel compiled for this GPU")

    def build_step(**kwargs):
        events.append("step built")
        return real_build_step(**kwargs)

    real_build_step = build_module.build_step
    monkeypatch.setattr(build_module, "build_step", build_step)
    start_as_compiled(monkeypatch, start, fill_the_jit_cache)
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "3", "--eval-every", "0",
                    "--output-dir", tmp_path / "run")  # fmt: skip
    assert code == 0, err
    assert events == [("started", (16, 3, 32, 32), True), "step built", "before the first step"]
