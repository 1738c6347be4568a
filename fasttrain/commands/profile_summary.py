"""``python -m fasttrain profile-summary TRACE_DIR``: the step breakdown, recomputed from saved
traces."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fasttrain.config.cli import Parser
from fasttrain.errors import UserError
from fasttrain.metrics.breakdown import find_traces, summarize, table


def main(argv: Sequence[str]) -> int:
    p = Parser(
        prog="python -m fasttrain profile-summary",
        description="Recompute the step-time breakdown (compute, NCCL, memcpy, idle, host waits) "
        "from saved torch.profiler traces: a run's profile/ directory or one trace file.",
    )
    p.add_argument("trace_dir", help="a --profile run's <output-dir>/profile, or a .pt.trace.json")
    p.add_argument("--json", help="also write every trace's breakdown to this JSON file")
    args = p.parse_args(argv)
    traces = find_traces(args.trace_dir)
    if not traces:
        where = Path(args.trace_dir)
        if where.is_dir() and (where.name == "profile" or (where / "config.yaml").is_file()):
            raise UserError(
                f"{args.trace_dir}: no *.pt.trace.json files: the run ended before the "
                "profiler's schedule recorded anything; run it with more steps (--max-steps) "
                "or a shorter --profile-wait"
            )
        raise UserError(f"{args.trace_dir}: no *.pt.trace.json files (run with --profile first)")
    summaries = [summarize(t) for t in traces]
    for s in summaries:
        print(table(s))
    print(
        "the traces, for ui.perfetto.dev or Chromium's chrome://tracing (both read them offline):"
    )
    for s in summaries:
        rank = s["rank"] if s["rank"] is not None else "?"
        print(f"  rank {rank}: {s['trace']}")
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(summaries, indent=2) + "\n")
    return 0
