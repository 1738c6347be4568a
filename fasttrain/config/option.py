"""An option: how one config field appears on the command line and in YAML, declared on the
field itself (``option``), so that a flag cannot exist without a config key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line and in YAML."""

    flag: str
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False  # None is allowed (YAML null; "auto"/"none" on the command line)
    # other spellings of the flag: torchvision's reference train.py's and timm's, same meaning
    aliases: tuple[str, ...] = ()
    # (other spelling, value) pairs of choices, e.g. torchvision's "cosineannealinglr"
    synonyms: tuple[tuple[str, str], ...] = ()
    # a string of this many ':'-separated integers (YAML may give them as a list); 0: any string
    parts: int = 0
    metavar: str | None = None  # --help's name for the value (default: the flag's, upper case)
    # (value of the bare flag, value of --no-FLAG), for a choice that is also a switch: the flag
    # alone and YAML's true mean the first, --no-FLAG and YAML's false the second
    switch: tuple[str, str] | None = None
    # (a float must also be finite: NaN and infinity are refused for every option)
    key: str = ""  # "section.field": filled by options()
    type: type = str  # int, float, str or bool: from the field's annotation


def option(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A config field declared with its option (see ``Option``)."""
    return field(default=default, metadata={"option": Option(flag, help, **kw)})
