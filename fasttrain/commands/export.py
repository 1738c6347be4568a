"""``python -m fasttrain export CHECKPOINT OUT``: a checkpoint's weights as torchvision's state
dict."""

from __future__ import annotations

from collections.abc import Sequence

from fasttrain.commands import say
from fasttrain.config.cli import Parser
from fasttrain.run.weights import export_state_dict, holds_average, load_file, state_dict_in


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
    loaded = load_file(args.checkpoint, flag="export")
    state = state_dict_in(loaded, args.checkpoint, "export", "model_ema" if args.ema else None)
    out = export_state_dict(state, args.out)
    which = "the moving average of its weights" if args.ema else "its model's weights"
    also = (
        "; it also holds their moving average, which --ema writes"
        if not args.ema and holds_average(loaded)
        else ""
    )
    say(f"wrote {which}, {len(state)} tensors of {args.checkpoint}, to {out}{also}")
    return 0
