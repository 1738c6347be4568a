"""The run's settings: the schema (each option declared once), the command line and YAML recipes
that fill it, and the option strings parsed into types. Nothing here imports torch."""

from fasttrain.config.data import DataConfig
from fasttrain.config.model import ARCHS, ModelConfig
from fasttrain.config.optim import OptimConfig
from fasttrain.config.option import Option, option
from fasttrain.config.run import RunConfig
from fasttrain.config.schema import OPTION_BY_KEY, OPTIONS, SECTIONS, Config
from fasttrain.config.train import COMPILE_MODES, KERNELS, TrainConfig

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
