"""Model construction: torchvision ResNets (no pretrained weights), channels_last, param groups."""

from __future__ import annotations

import torch
import torchvision
from torch import nn

from fasttrain.config import ModelConfig


def build_model(
    arch: str,
    num_classes: int,
    channels_last: bool,
    device: torch.device,
    *,
    zero_init_residual: bool = False,
    triton_maxpool: bool = False,
    fused_bn: bool = False,
    cudnn_bn: bool = False,
) -> nn.Module:
    """A freshly initialised torchvision model (weights=None: nothing is downloaded).

    ``zero_init_residual`` zeroes the last BN scale of every residual block, so each block starts
    as the identity: the large-batch ImageNet recipe (Goyal et al. 2017), and timm's default.
    ``triton_maxpool`` swaps the stem's max-pool for fasttrain's Triton one (no parameters: the
    state dict is torchvision's either way). ``fused_bn`` builds the same ResNet with BatchNorm
    folded into its convolutions (``FusedResNet``: same weights for a seed, same state dict);
    ``cudnn_bn`` the same ResNet with each BN, add and ReLU as one op (``BNActResNet``).
    """
    if fused_bn and cudnn_bn:
        raise ValueError("fused_bn and cudnn_bn are two ways to run BatchNorm: choose one")
    if cudnn_bn:
        from fasttrain.model.bn_act_resnet import BNActResNet

        model = BNActResNet(arch, num_classes=num_classes, zero_init_residual=zero_init_residual)
    elif fused_bn:
        from fasttrain.model.fused_resnet import FusedResNet

        model = FusedResNet(arch, num_classes=num_classes, zero_init_residual=zero_init_residual)
    else:
        model = getattr(torchvision.models, arch)(
            weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual
        )
    if triton_maxpool:
        from fasttrain.kernels.maxpool import MaxPool2d

        pool = model.maxpool
        if not MaxPool2d.replaces(pool):
            raise ValueError(f"{arch}'s max-pool {pool} is not one the Triton kernel computes")
        model.maxpool = MaxPool2d(pool.kernel_size, pool.stride, pool.padding)
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def build_configured_model(
    cfg: ModelConfig, num_classes: int, device: torch.device, kernels: set[str]
) -> nn.Module:
    """The model ``--arch`` and the model flags describe, with the ``--triton-kernels`` that
    change it: one place, so the trainer and ``--batch-size auto``'s trials build the same one."""
    return build_model(
        cfg.arch,
        num_classes,
        cfg.channels_last,
        device,
        zero_init_residual=cfg.zero_init_residual,
        triton_maxpool="maxpool" in kernels,
        fused_bn=_switch(cfg.fused_bn, "--fused-bn"),
        cudnn_bn=cfg.cudnn_bn,
    )


def _switch(value: str, flag: str) -> bool:
    """A resolved on/off option as a bool (``resolve`` settles ``auto`` first)."""
    if value not in ("on", "off"):
        raise ValueError(f"{flag} {value}: not resolved to on or off")
    return value == "on"


def param_groups(model: nn.Module, weight_decay: float, bn_weight_decay: bool) -> list[dict]:
    """Split parameters so BatchNorm weights and biases can be exempt from weight decay.

    (Exempting them is the usual large-batch ImageNet recipe: decaying BN's scale fights the
    normalisation rather than regularising.)
    """
    if bn_weight_decay:
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    norm, other = [], []
    for module in model.modules():
        is_norm = isinstance(module, nn.modules.batchnorm._NormBase | nn.GroupNorm | nn.LayerNorm)
        for p in module.parameters(recurse=False):
            (norm if is_norm else other).append(p)
    return [{"params": other, "weight_decay": weight_decay}, {"params": norm, "weight_decay": 0.0}]
