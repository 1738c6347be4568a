"""The run's settings: the schema (each option declared once), the command line and YAML recipes
that fill it, and the option strings parsed into types. Nothing here imports torch."""

from fasttrain.config.schema import (
    ARCHS,
    COMPILE_MODES,
    KERNELS,
    OPTION_BY_KEY,
    OPTIONS,
    SECTIONS,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    Option,
    RunConfig,
    TrainConfig,
    option,
)

__all__ = [
    "ARCHS",
    "COMPILE_MODES",
    "KERNELS",
    "OPTIONS",
    "OPTION_BY_KEY",
    "SECTIONS",
    "Config",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "Option",
    "RunConfig",
    "TrainConfig",
    "option",
]
