"""The ``model`` section: the architecture, its layout, its weights and its BatchNorm path."""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.config.option import option

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


@dataclass
class ModelConfig:
    arch: str = option(
        "resnet50",
        "--arch",
        "model architecture (torchvision, weights=None)",
        choices=ARCHS,
        aliases=("--model",),
    )
    num_classes: int | None = option(
        None,
        "--num-classes",
        "output classes (default: the number of class folders in train/, or 1000 for "
        "synthetic data)",
        minimum=2,
        nullable=True,
    )
    channels_last: bool = option(
        True,
        "--channels-last",
        "NHWC memory format for the model and inputs (faster convolutions on tensor cores)",
    )
    zero_init_residual: bool = option(
        True,
        "--zero-init-residual",
        "start each residual block's last BatchNorm scale at zero, so every block starts as the "
        "identity (Goyal et al. 2017; timm's ResNet default); steadies the first steps",
    )
    weights: str | None = option(
        None,
        "--weights",
        "start from these weights: a state dict file (torchvision's, timm's, an export, or a "
        "fasttrain checkpoint). A classifier for another number of classes is replaced by a new "
        "one (fine-tuning); anything else that does not fit is an error. Nothing is downloaded",
        nullable=True,
    )
    fused_bn: str = option(
        "auto",
        "--fused-bn",
        "fold BatchNorm into the convolutions: each convolution sums the next BN's statistics "
        "as it writes its output (cuDNN's fused convolution, fp16), so BN reads each activation "
        "once (to normalise) instead of twice. The weights and checkpoints stay torchvision's. "
        "auto: on a CUDA GPU where cuDNN takes every convolution of the model, trains in fp16 "
        "on the fused path; anywhere else the plain path, saying why at start. on (or the bare "
        "flag): the fused path, or a one-line error where a GPU cannot run it; on the CPU it "
        "runs the same decomposition in plain PyTorch, as a reference. off (--no-fused-bn): "
        "the plain path",
        choices=("auto", "on", "off"),
        switch=("on", "off"),
        metavar="{auto,on,off}",
    )
    cudnn_bn: bool = option(
        False,
        "--cudnn-bn",
        "run each BatchNorm, with the residual add and ReLU after it, as cuDNN's fused "
        "BatchNorm kernels (forward and backward) instead of the ones torch.compile generates. "
        "bf16 or fp16, channels_last, not with --fused-bn on; on the CPU it runs the same op "
        "in plain PyTorch. The weights and checkpoints stay torchvision's. Under --compile it "
        "measured slower than the kernels torch.compile generates (BENCHMARKS.md): it is there "
        "to compare the two on other GPUs and cuDNN versions",
    )
