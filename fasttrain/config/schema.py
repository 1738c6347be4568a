"""The config schema: the five sections (``data.py``, ``model.py``, ``optim.py``, ``train.py``,
``run.py``), each option declared once, on its field.

A field's metadata carries its flag, help, choices and bounds (``option.py``). The command line,
the YAML reader (``cli.py``) and the resolved-config writer are built from these fields, so a flag
cannot exist without a config key or the other way round. ``auto`` values (None here, or the
string "auto") are filled in one pass by ``run/resolve.py`` once the processes are up.

The config package imports nothing else of fasttrain and nothing heavy: it is the leaf every
other module may read.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fasttrain.config.data import DataConfig
from fasttrain.config.model import ModelConfig
from fasttrain.config.optim import OptimConfig
from fasttrain.config.option import Option
from fasttrain.config.run import RunConfig
from fasttrain.config.train import TrainConfig

if TYPE_CHECKING:
    from fasttrain.config.parse import Parsed


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # the resolved option strings parsed, once: set by ``resolve`` (``parse.Parsed``); not an
    # option, and not part of what the config says (``to_dict``, comparisons)
    parsed: Parsed | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The sections as YAML holds them: what ``config.yaml`` records."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def get(self, key: str) -> Any:
        """The value of the option at YAML key ``key`` (``section.name``)."""
        section, name = key.split(".")
        return getattr(getattr(self, section), name)

    @property
    def typed(self) -> Parsed:
        """``parsed``, which ``resolve`` sets; a config used before that is a bug."""
        if self.parsed is None:
            raise RuntimeError("the config is not resolved: resolve() (or Parsed.of) first")
        return self.parsed


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "run": RunConfig,
}


def _value_type(annotation: Any) -> type:
    """``int | None`` -> int: the type a value has when it is not None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def options() -> tuple[Option, ...]:
    """Every option, in declaration order, with its key and value type filled in."""
    found = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            o = f.metadata["option"]
            found.append(
                dataclasses.replace(o, key=f"{section}.{f.name}", type=_value_type(hints[f.name]))
            )
    return tuple(found)


OPTIONS = options()
OPTION_BY_KEY = {o.key: o for o in OPTIONS}
