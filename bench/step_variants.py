"""The training step's variants side by side on one GPU, in one process: eager, compiled and
graphed, at each batch size and inductor setting asked for (synthetic bf16 channels_last data,
ResNet-50 by default). Prints a markdown table; ``--jsonl`` also keeps every figure.

Usage on the GPU machine:
  python bench/step_variants.py --batch 256 512 --kinds eager compiled compiled+graph
  python bench/step_variants.py --kinds compiled+graph \
      --options none conv_1x1_as_mm,coordinate_descent_tuning
"""

from __future__ import annotations

import argparse
import json

import torch
from common import measure_step  # bench/common.py: the script's folder is on sys.path

from fasttrain.distributed import claim_hardware_queues


def main() -> None:
    claim_hardware_queues()  # as the trainer does (CUDA_DEVICE_MAX_CONNECTIONS), unless set
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--kinds", nargs="+", default=["eager", "compiled", "compiled+graph"])
    p.add_argument("--mode", default="default")
    p.add_argument("--options", nargs="+", default=["none"], help="--inductor-options values")
    p.add_argument("--kernels", nargs="+", default=["none"], help="--triton-kernels values")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--jsonl", help="append one JSON line per variant here")
    args = p.parse_args()
    torch.backends.cudnn.benchmark = True
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.arch}, bf16, "
        "channels_last, synthetic data | median of 6 blocks of 25 steps after 30 warm-up"
    )
    print(
        "| step | batch | mode | inductor options | Triton kernels | img/s | peak GiB "
        "| first step s | capture s |"
    )
    print("|---|---:|---|---|---|---:|---:|---:|---:|")
    variants = [(o, k) for o in args.options for k in args.kernels]
    for batch in args.batch:
        for options, kernels in variants:
            for kind in args.kinds:
                if "compiled" not in kind and options != args.options[0]:
                    continue  # options only change compiled variants
                r = measure_step(
                    kind, batch, arch=args.arch, mode=args.mode, options=options, kernels=kernels
                )
                cap = f"{r['capture_s']:.2f}" if r["capture_s"] is not None else ""
                if r["graph_failed"]:
                    cap = "failed"
                opts = options if "compiled" in kind else ""
                mode = args.mode if "compiled" in kind else ""
                print(
                    f"| {kind} | {batch} | {mode} | {opts} | {kernels} | {r['img_per_s']:,.0f} | "
                    f"{r['peak_mem_gib']:.2f} | {r['first_step_s']:.1f} | {cap} |",
                    flush=True,
                )
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps({"arch": args.arch, **r}) + "\n")


if __name__ == "__main__":
    main()
