"""The flag reference, docs/FLAGS.md, generated from the schema: every option's flag, its other
spellings, its YAML key, its default, the values it takes and its help, section by section.

``python -m fasttrain.config.reference > docs/FLAGS.md`` writes it; a test holds the file to
what this prints, so the reference cannot fall behind the flags.
"""

from __future__ import annotations

from fasttrain.config.option import Option
from fasttrain.config.schema import OPTIONS, SECTIONS, Config

HEADER = """# Flags

Every flag of `python -m fasttrain` (training, and `evaluate`, which takes the same flags), by
section of the YAML recipe that holds it: `--batch-size` is `train.batch_size` in a `--config`
file. Flags override the recipe, which overrides the defaults. A switch (`--compile`) has a
`--no-` form; `auto` values are settled at start-up, and the run's `config.yaml` records what
they became. Generated from the schema by `python -m fasttrain.config.reference`; do not edit.

Besides these, `--config FILE` names the recipe (default with no `--data`: `configs/sample.yaml` on
a GPU, `configs/sample_cpu.yaml` on the CPU) and `--nproc-per-node N` starts N processes on this
machine. The other commands (`env`, `check-data`, `profile-summary`, `export`) document their own
flags: `python -m fasttrain COMMAND --help`.
"""


def _values(o: Option) -> str:
    """What the option takes, in a few words."""
    if o.type is bool:
        return f"`{o.flag}` / `--no-{o.flag.removeprefix('--')}`"
    if o.choices:
        text = ", ".join(f"`{c}`" for c in o.choices)
        if o.switch:
            text += f" (`{o.flag}` alone: `{o.switch[0]}`; `--no-{o.flag[2:]}`: `{o.switch[1]}`)"
        return text
    bounds = []
    if o.minimum is not None:
        bounds.append(f"≥ {o.minimum:g}")
    if o.maximum is not None:
        bounds.append(f"≤ {o.maximum:g}")
    kind = {int: "integer", float: "number", str: "text"}[o.type]
    if o.metavar:
        kind = f"`{o.metavar}`"
    text = kind + (f" ({', '.join(bounds)})" if bounds else "")
    return text + ("; `auto` or `none`" if o.nullable and o.type in (int, float) else "")


def _default(value: object) -> str:
    if value is None:
        return "none"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def markdown() -> str:
    """docs/FLAGS.md's text."""
    defaults = Config()
    lines = [HEADER]
    for section in SECTIONS:
        lines += [
            f"## {section}",
            "",
            "| flag | YAML key | default | takes | what it does |",
            "|---|---|---|---|---|",
        ]
        for o in (o for o in OPTIONS if o.key.startswith(f"{section}.")):
            flags = ", ".join(f"`{f}`" for f in (o.flag, *o.aliases))
            help_text = o.help.replace("%%", "%").replace("|", "\\|")
            if o.synonyms:
                help_text += f" ({', '.join(f'`{a}`' for a, _ in o.synonyms)} are accepted too)"
            default = _default(defaults.get(o.key))
            lines.append(f"| {flags} | `{o.key}` | {default} | {_values(o)} | {help_text} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
