"""``python -m fasttrain export CHECKPOINT OUT``: a checkpoint's weights as torchvision's state
dict."""

from __future__ import annotations

from collections.abc import Sequence

from fasttrain.commands import say
from fasttrain.config.cli import Parser
from fasttrain.run.weights import export_state_dict, read_state_dict


def main(argv: Sequence[str]) -> int:
    p = Parser(
        prog="python -m fasttrain export",
        description="Write a checkpoint's model weights as a plain state dict with torchvision's "
        "keys (no optimizer, no loader state), which torchvision.models.<arch>(num_classes=N) "
        "loads as it is. A checkpoint's BatchNorm statistics are already averaged over the "
        "ranks. The format follows OUT's suffix: .safetensors (needs the safetensors package) "
        "or a torch file (.pt, .pth).",
    )
    p.add_argument("checkpoint", help="a fasttrain checkpoint (ckpt-*.pt) or any state dict file")
    p.add_argument("out", help="where to write the weights (.pt, .pth or .safetensors)")
    p.add_argument(
        "--ema",
        action="store_true",
        help="write the checkpoint's moving average of the weights (a --model-ema run's)",
    )
    args = p.parse_args(argv)
    state = read_state_dict(args.checkpoint, flag="export", key="model_ema" if args.ema else None)
    out = export_state_dict(state, args.out)
    say(f"wrote {len(state)} tensors of {args.checkpoint} to {out}")
    return 0
