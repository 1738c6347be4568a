"""cuDNN's convolutions ahead of the first step: the convolutions a forward on fake tensors
records, that running them is valid (torch checks every argument) and touches nothing of the
model, and the thread's life around dynamo's end of compile. On the CPU: cuDNN's side is GPU
work, run by every compiled GPU start."""

import pytest
import torch
import torchvision

from fasttrain.model.fused_resnet import FusedResNet
from fasttrain.step import conv_warmup
from fasttrain.step.conv_warmup import ConvWarmup, Spec, record


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


def test_the_thread_is_waited_for_at_the_end_of_a_compile(monkeypatch):
    from torch._dynamo.callback import callback_handler

    model = torchvision.models.resnet18().to(memory_format=torch.channels_last)
    warmup = ConvWarmup(model, None, nhwc_example(2, 32), torch.device("cpu"))
    warmup.wait()  # not started: returns at once
    warmup.start()
    assert warmup._compiled in callback_handler.end_callbacks
    assert warmup._compiling in callback_handler.start_callbacks
    assert not warmup.compiling.wait(0.5)  # no convolution runs before a compile starts
    compiled = torch.compile(lambda x: x * 2, backend="eager")
    compiled(torch.ones(2))  # dynamo's start of a compile lets it run, the end waits for it
    assert not warmup.thread.is_alive() and warmup.failed is None
    assert len(warmup.convs) == 11 and warmup.seconds > 0
    assert warmup._compiled not in callback_handler.end_callbacks
    assert warmup._compiling not in callback_handler.start_callbacks


def test_a_start_that_compiles_nothing_runs_no_convolution(monkeypatch):
    monkeypatch.setattr(conv_warmup, "WAIT_FOR_COMPILE_S", 0.1)
    ran = []
    monkeypatch.setattr(conv_warmup.Conv, "run", lambda self, device: ran.append(self))
    model = torchvision.models.resnet18().to(memory_format=torch.channels_last)
    warmup = ConvWarmup(model, None, nhwc_example(2, 32), torch.device("cpu"))
    warmup.thread.start()  # no callbacks: no compile will start
    warmup.wait()
    assert warmup.failed == "no compile started" and ran == [] and warmup.convs == []


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
