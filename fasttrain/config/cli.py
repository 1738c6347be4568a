"""The command line and YAML recipes, both built from the schema in ``config.py``.

Defaults <- a ``--config`` recipe <- flags. Values are type- and range-checked here, naming the
flag or the recipe's file and key. Nothing here imports torch, so parsing (and ``--help``) stays
fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fasttrain.config.option import Option
from fasttrain.config.paths import config_dir
from fasttrain.config.schema import OPTION_BY_KEY, OPTIONS, SECTIONS, Config
from fasttrain.errors import UserError

NULL_WORDS = ("auto", "none", "null")  # a nullable number's flag takes these for None


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line and a pointer to --help (argparse's own prints
    the whole usage, dozens of lines, before the one that matters)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser_for(o: Option):
    """The string -> value conversion argparse applies to one flag."""
    if o.nullable and o.type in (int, float):
        return lambda s: None if s.lower() in NULL_WORDS else o.type(s)
    if o.synonyms:
        return lambda s: dict(o.synonyms).get(s.lower(), s)
    return o.type


def _check(o: Option, value: Any, where: str) -> Any:
    """Type- and range-check one value; ``where`` names the flag, or the YAML file and key."""
    if value is None:
        if o.nullable:
            return None
        raise UserError(f"{where}: a value is required")
    if o.type is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
    elif o.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: expected an integer, got {value!r}")
    elif o.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}: expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise UserError(f"{where}: expected a finite number, got {value}")
    elif o.parts:
        value = _parts(o, value, where)
    elif o.switch is not None and isinstance(value, bool):  # YAML's true / false
        value = o.switch[0] if value else o.switch[1]
    elif not isinstance(value, str):
        raise UserError(f"{where}: expected a string, got {value!r}")
    else:
        value = dict(o.synonyms).get(value.lower(), value) if o.synonyms else value
    if o.choices is not None and value not in o.choices:
        raise UserError(f"{where}: {value!r} is not allowed; choose one of {', '.join(o.choices)}")
    if o.minimum is not None and value < o.minimum:
        raise UserError(f"{where} must be at least {o.minimum:g} (got {value})")
    if o.maximum is not None and value > o.maximum:
        raise UserError(f"{where} must be at most {o.maximum:g} (got {value})")
    return value


def _parts(o: Option, value: Any, where: str) -> str | None:
    """A value of ``o.parts`` integers: ``"a:b:c:d"`` or, from YAML, ``[a, b, c, d]``; the
    string form either way. ``none`` turns a nullable one off."""
    if isinstance(value, str) and o.nullable and value.lower() in NULL_WORDS:
        return None
    items = value.split(":") if isinstance(value, str) else value
    ok = isinstance(items, list) and len(items) == o.parts
    if ok and not isinstance(value, str):  # YAML's numbers must be integers already
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in items)
    if ok:
        try:
            return ":".join(str(int(v)) for v in items)
        except ValueError:
            pass
    raise UserError(
        f"{where}: expected {o.metavar or f'{o.parts} integers joined by :'}, got {value!r}"
    )


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a recipe: two levels, ``section: {key: value}``; unknown keys are errors."""
    if not path.is_file():
        raise UserError(f"--config {path}: file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:  # a binary file
        raise UserError(f"--config {path}: not a YAML text file (not UTF-8 text)") from None
    except OSError as e:
        raise UserError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"--config {path}: not valid YAML{line}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected sections ({', '.join(SECTIONS)}) at the top")
    values: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise UserError(f"{path}: unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise UserError(f"{path}: section {section!r} must map keys to values")
        allowed = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for k, v in body.items():
            key = f"{section}.{k}"
            if key not in OPTION_BY_KEY:
                raise UserError(
                    f"{path}: unknown key {key!r}; allowed in {section}: {', '.join(allowed)}"
                )
            values[key] = _check(OPTION_BY_KEY[key], v, f"{path}: {key}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m fasttrain",
        description="Train an image classifier (ResNet-50 by default) on an ImageNet-style JPEG "
        "folder, or on the built-in sample dataset when --data is not given. Flags override the "
        "--config recipe, which overrides the defaults. Other commands: `python -m fasttrain env` "
        "reports hardware and software; `python -m fasttrain check-data DIR` finds undecodable "
        "images and writes the list training then leaves out; `python -m fasttrain "
        "profile-summary TRACE_DIR` recomputes a --profile run's step breakdown; `python -m "
        "fasttrain evaluate WEIGHTS [flags]` evaluates weights on a val set (--test-only); "
        "`python -m fasttrain export CHECKPOINT OUT` writes a checkpoint's weights as "
        "torchvision's state dict.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the recipe
    )
    p.add_argument(
        "--config",
        type=Path,
        help="YAML recipe (see configs/); flags override it. Default with no --data: "
        "configs/sample.yaml on a GPU, configs/sample_cpu.yaml on the CPU",
    )
    p.add_argument(
        "--nproc-per-node",
        dest="launch.nproc",
        metavar="N",
        type=int,
        help="launch N processes on this machine through torch.distributed.run (as torchrun "
        "--standalone does), one per GPU, training with DDP; for several machines use torchrun",
    )
    defaults = Config()
    groups = {name: p.add_argument_group(f"{name} (YAML section '{name}')") for name in SECTIONS}
    for o in OPTIONS:
        section = o.key.split(".")[0]
        default = defaults.get(o.key)
        # argument_default=SUPPRESS hides argparse's own defaults, so write them in here
        help_text = o.help + ("" if default is None else f" (default: {default})")
        group = groups[section]
        if o.synonyms:
            help_text += f"; {', '.join(a for a, _ in o.synonyms)} are accepted too"
        if o.type is bool:
            group.add_argument(
                o.flag,
                *o.aliases,
                dest=o.key,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            metavar = o.metavar or (
                None if o.choices else o.flag.lstrip("-").upper().replace("-", "_")
            )
            switch = {"nargs": "?", "const": o.switch[0]} if o.switch else {}
            group.add_argument(
                o.flag,
                *o.aliases,
                dest=o.key,
                metavar=metavar,
                type=_parser_for(o),
                choices=o.choices,
                help=help_text,
                **switch,
            )
            if o.switch:  # --no-FLAG: the switch's off value
                group.add_argument(
                    "--no-" + o.flag.removeprefix("--"),
                    dest=o.key,
                    action="store_const",
                    const=o.switch[1],
                    help=f"the same as {o.flag} {o.switch[1]}",
                )
    return p


def parse_args(argv: Sequence[str], cuda_available: bool) -> tuple[Config, list[str]]:
    """Defaults <- recipe <- flags. Returns the config and notes to show the user once.
    ``cuda_available`` picks the built-in sample recipe when neither --data nor --config is
    given."""
    parser = build_parser()
    try:
        ns = vars(parser.parse_args(list(argv)))
    except SystemExit as e:  # argparse already printed a one-line usage error
        raise SystemExit(2 if e.code else 0) from None
    notes: list[str] = []
    ns.pop("launch.nproc", None)  # __main__ launches the processes before parsing
    recipe: Path | None = ns.pop("config", None)
    if recipe is None and ns.get("data.path") is None and ns.get("data.loader") != "synthetic":
        recipe = config_dir() / ("sample.yaml" if cuda_available else "sample_cpu.yaml")
        if not cuda_available:
            notes.append(
                f"no CUDA GPU found: training the CPU-sized sample run ({recipe.name}: "
                "smaller images, fewer steps); pass --data and flags to change it"
            )
    values: dict[str, Any] = load_yaml(recipe) if recipe is not None else {}
    for key, v in ns.items():
        values[key] = _check(OPTION_BY_KEY[key], v, OPTION_BY_KEY[key].flag)
    cfg = Config()
    for key, v in values.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, v)
    return cfg, notes


def save_resolved(cfg: Config, path: Path) -> None:
    """Write the resolved config; ``--config`` of this file reproduces the run."""
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
