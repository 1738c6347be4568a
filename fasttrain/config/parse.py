"""The option strings that hold several values, parsed into types, once.

The config keeps each option as the command line and YAML give it (a string such as
``maxpool,sgd`` or ``160:1024,192:704``), which is what the run's ``config.yaml`` records. What
the code reads is ``Parsed``: the resolved strings parsed once, when ``resolve`` has filled them
in (``Config.parsed``). Nothing here imports torch but ``inductor_options``, which checks names
against inductor's own settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import yaml

from fasttrain.config.resolution import Resolution, parse_batch_sizes, train_resolution
from fasttrain.config.train import KERNELS
from fasttrain.errors import UserError

if TYPE_CHECKING:
    from fasttrain.config.schema import Config


@dataclass(frozen=True)
class Parsed:
    """What a resolved config's strings mean: ``resolve`` builds it as it checks them, and
    everything after reads it (``Config.parsed``)."""

    kernels: frozenset[str]  # --triton-kernels
    inductor: Mapping[str, Any]  # --inductor-options (empty without --compile)
    resolution: Resolution  # the train crop of each epoch: --image-size, --progressive-resizing
    batch_sizes: Mapping[int, int] = field(default_factory=dict)  # --batch-sizes
    # the BatchNorm path --fused-bn and --cudnn-bn settled on, in words, with the reason where
    # --fused-bn auto chose the plain one: for the start-up line
    bn_path: str = "plain"

    @classmethod
    def of(cls, cfg: Config) -> Parsed:
        """Parse a config resolved elsewhere (a benchmark's, a test's) in one go."""
        t, m = cfg.train, cfg.model
        return cls(
            kernels=triton_kernels(t.triton_kernels),
            inductor=inductor_options(t.inductor_options) if t.compile else {},
            resolution=train_resolution(cfg.data),
            batch_sizes=parse_batch_sizes(t.batch_sizes),
            bn_path="cuDNN's BatchNorm kernels (--cudnn-bn)"
            if m.cudnn_bn
            else f"folded into the convolutions (--fused-bn {m.fused_bn})"
            if m.fused_bn == "on"
            else "plain",
        )


def triton_kernels(text: str) -> frozenset[str]:
    """The set ``--triton-kernels`` names (resolved: never "auto"); an unknown name is a
    one-line error."""
    names = {k.strip() for k in text.split(",") if k.strip() and k.strip() != "none"}
    unknown = names - set(KERNELS)
    if unknown:
        raise UserError(
            f"--triton-kernels: unknown {', '.join(sorted(unknown))}; choose from "
            f"{', '.join(KERNELS)} or none"
        )
    return frozenset(names)


def inductor_options(text: str | None) -> dict[str, Any]:
    """Parse ``NAME[=VALUE],...`` against torch._inductor.config; a bare NAME means True."""
    if text in (None, "", "none"):
        return {}
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    items: list[str] = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        # a string setting's value may hold commas itself (max_autotune_gemm_backends=ATEN,TRITON)
        if items and "=" not in item and item not in known and "=" in items[-1]:
            items[-1] += "," + item
        else:
            items.append(item)
    options: dict[str, Any] = {}
    for item in items:
        name, _, raw = item.partition("=")
        name = name.strip()
        if name not in known:
            raise UserError(
                f"--inductor-options: {name!r} is not a torch._inductor.config setting "
                "(e.g. conv_1x1_as_mm, coordinate_descent_tuning, max_autotune)"
            )
        if not raw:
            options[name] = True
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        default = known[name]
        if default is not None and not isinstance(value, type(default)):
            raise UserError(
                f"--inductor-options: {name}={raw} should be a {type(default).__name__} "
                f"like its default {default!r}"
            )
        options[name] = value
    return options
