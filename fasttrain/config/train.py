"""The ``train`` section: how the step runs (length, batch, precision, compile, CUDA graphs,
kernels), over how many GPUs (DDP), what it does to each batch on the device (erasing, mixup /
CutMix), the weights' moving average, faults and reproducibility."""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.config.option import option

COMPILE_MODES = ("auto", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
KERNELS = ("normalize", "sgd", "xent", "maxpool")  # --triton-kernels names, in canonical order


@dataclass
class TrainConfig:
    epochs: int = option(
        90, "--epochs", "number of epochs; the LR schedule spans them all", minimum=1
    )
    max_steps: int | None = option(
        None,
        "--max-steps",
        "stop after this many optimizer steps (the LR schedule still follows --epochs, so a "
        "stopped run can be resumed exactly)",
        minimum=1,
        nullable=True,
    )
    batch_size: int | None = option(
        256,
        "--batch-size",
        "images per process per micro-step; the global batch is batch-size x processes x "
        "accum-steps. auto: the largest that fits this GPU with 10%% of its memory left free, "
        "found by running the real step (capture included) at growing sizes before training "
        "(with --progressive-resizing, at each size: --batch-sizes)",
        minimum=1,
        nullable=True,
        aliases=("-b",),
    )
    batch_sizes: str | None = option(
        None,
        "--batch-sizes",
        "with --progressive-resizing, a train size's own batch per process, as SIZE:BATCH "
        "pairs (e.g. 160:1024,192:704); the other sizes take --batch-size. An epoch at such a "
        "size takes fewer, larger steps, and its LR follows its global batch (--lr-scaling "
        "linear). --batch-size auto fills it in, measuring each size",
        nullable=True,
        metavar="SIZE:BATCH[,SIZE:BATCH...]",
    )
    accum_steps: int = option(
        1,
        "--accum-steps",
        "micro-batches accumulated per optimizer step (gradient accumulation)",
        minimum=1,
    )
    amp: str = option(
        "auto",
        "--amp",
        "mixed precision: bf16, fp16 (with a GradScaler), off, or auto: fp16 on the fused "
        "BatchNorm path (--fused-bn), bf16 on the plain path on a GPU, off on the CPU. bf16 or "
        "off with --fused-bn auto means the plain path",
        choices=("auto", "bf16", "fp16", "off"),
    )
    compile: bool = option(
        False, "--compile", "torch.compile the model for training and evaluation"
    )
    compile_mode: str = option(
        "auto",
        "--compile-mode",
        "torch.compile mode. auto: on a GPU, default plus inductor's coordinate_descent_tuning "
        "(its first start tunes every Triton kernel, minutes for ResNet-50; later starts reuse "
        "inductor's cache); on the CPU and for the built-in sample demo, where tuning would "
        "outlast the run, default alone. The modes that capture CUDA graphs of their own "
        "(reduce-overhead, max-autotune) cannot be combined with --cuda-graphs",
        choices=COMPILE_MODES,
    )
    inductor_options: str | None = option(
        None,
        "--inductor-options",
        "comma-separated inductor settings for --compile, NAME or NAME=VALUE "
        "(torch._inductor.config), e.g. conv_1x1_as_mm,max_autotune; 'none' for none. Under "
        "--compile-mode auto on a GPU, coordinate_descent_tuning joins them unless they set it",
        nullable=True,
    )
    tune_kernels: str = option(
        "auto",
        "--tune-kernels",
        "when inductor's coordinate-descent tuning (--compile-mode auto on a GPU) runs where its "
        "cache has no result: first-step (each kernel at its first call: the first start's "
        "first step waits for all of it), later (training starts on the untuned kernels, "
        "which --compile-mode default runs, while inductor's compile workers compile the "
        "tuning's candidates; once they have, one step tunes every kernel and the CUDA graphs "
        "are captured again; one process only), or auto: later where one process trains, "
        "first-step where several do",
        choices=("auto", "first-step", "later"),
    )
    compile_cache: str | None = option(
        None,
        "--compile-cache",
        "directory for the compile caches: inductor's (TORCHINDUCTOR_CACHE_DIR, one "
        "folder per set of settings that shape the step) and Triton's; on a filesystem every "
        "node sees, the first node's compile serves the others and the next job. Default: "
        "$FASTTRAIN_CACHE/compile, else ~/.cache/fasttrain/compile (with --no-trace-cache and "
        "no $FASTTRAIN_CACHE: inductor's own). A run also keeps its compiled artifacts next to "
        "its checkpoints, so a resume on another machine starts warm",
        nullable=True,
    )
    trace_cache: bool = option(
        True,
        "--trace-cache",
        "with --compile: keep dynamo's trace of the step in the compile cache too (torch's "
        "caching precompile), so that a warm start neither traces the step nor rebuilds its "
        "graphs (BENCHMARKS.md, start-up). Used by a single process whose "
        "step's shapes are fixed for the run: not under DDP, --batch-size auto, --batch-sizes "
        "or --progressive-resizing; --no-trace-cache traces at every start",
    )
    cuda_graphs: bool = option(
        False,
        "--cuda-graphs",
        "capture the whole training step (forward, backward, all-reduce, optimizer, LR, "
        "metrics) in one CUDA graph and replay it: the host launches one graph per step; with "
        "--compile or without",
    )
    triton_kernels: str = option(
        "auto",
        "--triton-kernels",
        "fasttrain's Triton kernels to use instead of the torch path, comma-separated: "
        "normalize (the torchvision loader's uint8 -> normalised input, one pass), sgd (the "
        "optimizer over flat buffers, one launch), xent (fused softmax cross-entropy with label "
        "smoothing), maxpool (the stem's max-pool, forward and backward), none, or auto: those "
        "measured faster than the torch path in the step (maxpool with channels_last on a GPU; "
        "normalize with the torchvision loader on a GPU)",
    )
    strategy: str = option(
        "auto",
        "--strategy",
        "data parallelism: ddp (DistributedDataParallel, one process per GPU: torchrun or "
        "--nproc-per-node), dp (nn.DataParallel over every visible GPU in one process: the "
        "classic baseline), none, or auto: ddp with several processes, else none",
        choices=("auto", "ddp", "dp", "none"),
    )
    bucket_cap_mb: int | None = option(
        None,
        "--bucket-cap-mb",
        "DDP gradient bucket size in MB (all-reduces start per bucket during the backward); "
        "auto: 100 when every rank is on one node (fewer, larger all-reduces inside the graph), "
        "25 (PyTorch's default, more overlap for a slower network) across nodes",
        minimum=1,
        nullable=True,
    )
    broadcast_buffers: bool = option(
        False,
        "--broadcast-buffers",
        "DDP: copy rank 0's BatchNorm statistics to every rank on every forward (off: each rank "
        "keeps its own, and they are averaged before each evaluation and checkpoint)",
    )
    sync_bn: bool = option(
        False,
        "--sync-bn",
        "DDP: SyncBatchNorm, batch statistics over the global batch (an all-gather per BN layer)",
    )
    ddp_comm_hook: str = option(
        "none",
        "--ddp-comm-hook",
        "DDP gradient all-reduce: none (fp32, exact) or PyTorch's bf16 / fp16 compression hook "
        "(each bucket cast to 16 bits, all-reduced, cast back: half the bytes on the wire, at "
        "16-bit precision of the averaged gradient; for links slower than NVLink)",
        choices=("none", "bf16", "fp16"),
    )
    dist_timeout: int = option(
        600,
        "--dist-timeout",
        "seconds a collective may wait before the run fails with an error naming the rank and "
        "the collective, instead of hanging",
        minimum=1,
    )
    on_nan: str = option(
        "stop",
        "--on-nan",
        "a non-finite loss (checked at log steps, from a device counter: no extra sync): stop "
        "writes nonfinite.json (step, LR, last finite loss) and exits 3; skip restores the "
        "newest checkpoint in place and trains on from the current step",
        choices=("stop", "skip"),
    )
    device: str = option("auto", "--device", "device to train on", choices=("auto", "cuda", "cpu"))
    random_erase: float = option(
        0.0,
        "--random-erase",
        "random erasing: the share of train images in which a random box (2-33%% of the image, "
        "aspect 0.3-3.3) is set to the mean colour, on the device inside the step, as "
        "torchvision's RandomErasing (0: off; torchvision's v2 recipe: 0.25)",
        minimum=0,
        maximum=1,
    )
    mixup_alpha: float = option(
        0.0,
        "--mixup-alpha",
        "mixup: blend each batch with itself rolled by one, lam ~ Beta(alpha, alpha), on the "
        "device inside the step; soft targets in the loss (0: off; torchvision's v2 recipe: 0.2)",
        minimum=0,
        aliases=("--mixup",),
    )
    cutmix_alpha: float = option(
        0.0,
        "--cutmix-alpha",
        "CutMix: paste a box of the rolled batch, its area 1 - lam, lam ~ Beta(alpha, alpha) "
        "(0: off; torchvision's v2 recipe: 1.0). With --mixup-alpha too, each batch takes one",
        minimum=0,
        aliases=("--cutmix",),
    )
    mixup_prob: float = option(
        1.0, "--mixup-prob", "share of batches that mixup/CutMix mixes", minimum=0, maximum=1
    )
    mixup_switch_prob: float = option(
        0.5,
        "--mixup-switch-prob",
        "with both --mixup-alpha and --cutmix-alpha: the share of mixed batches that take CutMix",
        minimum=0,
        maximum=1,
    )
    model_ema: bool = option(
        False,
        "--model-ema",
        "keep an exponential moving average of the weights, updated on the device after each "
        "optimizer step (inside the CUDA graph); it is evaluated beside the model (ema_top1) "
        "and checkpointed, and `export --ema` writes it",
    )
    model_ema_decay: float = option(
        0.9998,
        "--model-ema-decay",
        "--model-ema: the average's decay per update",
        minimum=0,
        maximum=1,
    )
    model_ema_steps: int = option(
        1, "--model-ema-steps", "--model-ema: optimizer steps between updates", minimum=1
    )
    model_ema_warmup: bool = option(
        False,
        "--model-ema-warmup",
        "--model-ema: timm's warm-up, decay = min(decay, (1 + n) / (10 + n)) after n updates, "
        "so the first weights do not linger",
    )
    deterministic: bool = option(
        False,
        "--deterministic",
        "reproducible runs: cuDNN's deterministic algorithms without autotuning, "
        "torch.use_deterministic_algorithms (an op that has no deterministic kernel warns in "
        "the log), CUBLAS_WORKSPACE_CONFIG=:4096:8 and inductor's deterministic mode; the "
        "loaders follow --seed either way. Slower on a GPU: cuDNN and inductor cannot pick "
        "their fastest kernels",
    )
    seed: int = option(
        0,
        "--seed",
        "seed for initialisation, shuffling and augmentation",
        minimum=0,
        maximum=2**32 - 1,  # what numpy's and DALI's seeds take
    )
