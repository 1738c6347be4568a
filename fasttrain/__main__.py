"""Entry point: ``python -m fasttrain [flags]`` trains; ``python -m fasttrain env`` reports.

Parse -> Config -> train. A ``UserError`` anywhere becomes one line on stderr and its exit code.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch

    from fasttrain.errors import UserError

    if argv[:1] == ["env"]:
        from fasttrain.envreport import env_report

        print(env_report())
        return 0
    try:
        from fasttrain.config import cache_dir, parse_args, resolve
        from fasttrain.distributed import DistState

        cuda = torch.cuda.is_available()
        cfg, notes = parse_args(argv, cuda_available=cuda)
        for note in notes:
            print(f"fasttrain: {note}", file=sys.stderr)
        resolve(cfg, cuda_available=cuda)
        dist = DistState.from_env(cfg.train.device)
        if cfg.data.path is None and cfg.data.loader != "synthetic":
            from fasttrain.data.sample import build_sample

            def say(msg: str) -> None:
                if dist.is_main:
                    print(f"fasttrain: {msg}", file=sys.stderr)

            t_build = time.perf_counter()
            cfg.data.path = str(build_sample(cache_dir(), log=say))
            if time.perf_counter() - t_build > 1:
                say(f"sample dataset ready after {time.perf_counter() - t_build:.0f} s")
            t_start = time.perf_counter()  # a one-off build is not part of the start-up cost
        from fasttrain.train import train

        train(cfg, dist, t_start)
    except UserError as e:
        print(f"fasttrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fasttrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
