"""The start-up probe behind --fused-bn auto and on: the fused model's cuDNN convolutions, found
by walking the model on the meta device, and the ones cuDNN declines."""

from __future__ import annotations

import pytest
import torch

from fasttrain.model.fused_support import ConvShape, FusedSupport, check, conv_shapes


def test_the_probe_asks_about_every_fused_convolution_of_the_model():
    """ResNet-50's convolutions through cuDNN at batch 256 and 224 px: every one but the stem's,
    each distinct shape once (22 of them), with the downsamples' stride-2 1x1 ones; a second
    size adds its own."""
    shapes = conv_shapes("resnet50", 256, [224])
    assert len(shapes) == 22 and all(s.w[1] != 3 for s in shapes)  # no stem
    assert ConvShape((256, 64, 56, 56), (64, 64, 3, 3), 1, 1) in shapes  # layer1's 3x3
    assert ConvShape((256, 1024, 14, 14), (2048, 1024, 1, 1), 2, 0) in shapes  # a downsample
    assert not any(s.prologue for s in shapes)  # the default folds no BN into a convolution
    both = conv_shapes("resnet50", 256, [160, 224])
    assert set(shapes) < set(both) and len(both) == 44
    assert len(conv_shapes("resnet18", 32, [64])) == 10


def test_the_probe_says_why_without_a_gpu_or_frontend(monkeypatch):
    import torch

    from fasttrain.model import fused_support
    from fasttrain.model.cudnn import graph as cudnn_graph

    cpu = fused_support.check("resnet50", 256, [224], torch.device("cpu"))
    assert not cpu.runs and cpu.why_not() == "it needs a CUDA GPU"
    monkeypatch.setattr(cudnn_graph, "available", lambda: False)
    found = fused_support.check("resnet50", 256, [224], torch.device("cuda"))
    assert not found.runs and "the cuDNN frontend is not installed" in found.why_not()
    asked = []
    monkeypatch.setattr(cudnn_graph, "available", lambda: True)
    monkeypatch.setattr(cudnn_graph, "version", lambda: 91900)

    def supported(x, w, stride, padding, prologue, device):
        asked.append((x, w))
        return w[2] == 1  # this cuDNN takes the 1x1 convolutions only

    from fasttrain.model.cudnn import conv_bn as cudnn_conv_bn

    monkeypatch.setattr(cudnn_conv_bn, "supported", supported)
    found = fused_support.check("resnet18", 32, [64], torch.device("cuda"))
    assert len(asked) == 10 and not found.runs
    assert len(found.declined) == 7  # resnet18's 3x3 shapes (its 1x1 are the downsamples)
    assert found.why_not().startswith("cuDNN 9.19 on this GPU")
    assert isinstance(found, FusedSupport)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_cudnn_takes_every_fused_convolution_of_a_resnet_on_this_gpu(arch, cudnn_frontend):
    """On an H200 with cuDNN 9.19, every convolution the fused model sends through cuDNN, at
    the sample recipe's batch and size and at progressive resizing's smaller one."""
    found = check(arch, 256, [160, 224], torch.device("cuda"))
    assert found.runs, found.why_not()
    assert len(found.shapes) == (2 * 22 if arch == "resnet50" else 2 * 10)
