"""Where compiled code is kept, so that a start compiles as little as possible.

- **The caches' directory** (``--compile-cache``, else ``$FASTTRAIN_CACHE/compile`` or
  ``~/.cache/fasttrain/compile``; with no trace kept and neither set, inductor's own): inductor's
  caches go to a folder of it per key (below), ``TORCHINDUCTOR_CACHE_DIR``, and Triton's to its
  ``triton`` folder (``TRITON_CACHE_DIR``, keyed by each kernel's source), so a directory on a
  shared filesystem lets every node and the next job find what one compiled. Every rank compiles
  for ``cuda:0`` (``dist/devices.py``), so ranks share entries too.
- **Dynamo's trace** (``--trace-cache``): torch's caching precompile keeps dynamo's transformed
  step and its guards in inductor's folder (``dynamo/``), so a warm start skips the trace and the
  graphs' rebuild. Evaluation is compiled without it (``step/inductor_setup.py`` says why). It
  keeps no guard on objects' identity (they differ in every process) and is keyed by the step's
  source alone, and a trace loaded and then failing its guards cannot be retraced in the same
  process (seen on torch 2.14). So inductor's folder is one per key, which
  holds every setting that shapes the step: no trace meets other settings. Where the shapes
  change within a run (``--batch-size auto``, ``--batch-sizes``, ``--progressive-resizing``) it is
  not used, nor with several processes: DDP's graphs, split at its buckets by dynamo, fail
  AOT autograd's cache entry when the trace is kept ("expected OutputCode", torch 2.14), and
  with torch's bundled AOT cache set to avoid that, a warm start compiled them again (slower
  than without the trace; docs/DESIGN.md).
- **cuDNN's chosen plans** (``cudnn-plans.json`` in inductor's folder for the key): the plan
  each of cuDNN's fused graphs chose at its first start, which a warm start builds alone instead
  of timing them all (``model/cudnn/plans_kept.py``).
- **The run's own artifacts** (``<run>/compile-cache/<key>.bin``): torch's portable cache
  artifacts (``torch.compiler.save_cache_artifacts``: the FX graph, AOT autograd, Triton and
  autotuning caches, and dynamo's trace), saved by the main process after the first step and
  again at a checkpoint when more was compiled (evaluation's model), never replaced by less
  (``Artifacts.load`` says why), and loaded into the caches
  when a run starts in that folder, before the step is built (``torch.compile`` looks for the
  trace as it wraps the function): a resume on a new machine starts warm. Beside them,
  ``<key>.triton.tar.gz`` holds the Triton kernels the step's launchers run, which torch's
  artifacts lack once coordinate descent has tuned them (``run/kernels_kept.py``). Both are
  saved again after ``--tune-kernels later``'s tuning step, whose results torch's compile
  records do not count. CUDA's JIT cache, where small, is kept in the run's folder and in the
  caches' directory, and put back where a machine's own is empty (``run/jit_kept.py``). The
  key holds torch's, Triton's and cuDNN's versions, the GPU and every setting that shapes the
  compiled step, so any change misses cleanly (a new file); inductor's own keys still guard
  every entry inside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
from pathlib import Path

import torch

from fasttrain.config import Config
from fasttrain.config.paths import cache_dir
from fasttrain.files import write_whole
from fasttrain.metrics.startup import compile_totals
from fasttrain.model.cudnn.plans_kept import keep_plans
from fasttrain.run.jit_kept import JitKept, places
from fasttrain.run.kernels_kept import launched_kernels, pack, triton_dir, unpack

log = logging.getLogger("fasttrain")

FOLDER = "compile-cache"
SHARED = "artifacts.bin"  # in inductor's folder for the key (Artifacts)
PLANS = "cudnn-plans.json"  # cuDNN's chosen plans, in the same folder (model/cudnn/plans_kept.py)
KERNELS = ".triton.tar.gz"  # beside the run's artifacts: the kernels its launchers run


def configure_compile_caches(cfg: Config, world_size: int) -> Path | None:
    """Point inductor and Triton at the compile cache (module notes), with dynamo's trace kept
    where ``trace_cache_applies``, and let AOT autograd cache graphs that hold fasttrain's
    autograd Functions; returns inductor's directory, or None where inductor keeps its own
    default (no directory given, no ``$FASTTRAIN_CACHE``, ``--no-trace-cache``).

    AOT autograd's cache passes over any graph with a custom ``autograd.Function`` unless told
    otherwise (``autograd_cache_allow_custom_autograd_functions``), and the fused path's
    affine-ReLU and residual-ReLU steps are such Functions: every start then traced the joint
    graph again. Dynamo traces both directions of these Functions into the graph (they are
    pure torch ops), so the graph the cache is keyed on holds them whole. cuDNN's chosen plans
    are kept in the same folder (``PLANS``)."""
    import torch._dynamo.config as dynamo_config
    from torch._functorch import config as functorch_config

    functorch_config.autograd_cache_allow_custom_autograd_functions = True
    dynamo_config.caching_precompile = trace_cache_applies(cfg, world_size)
    if dynamo_config.caching_precompile:  # it warns of each guard it drops, by design: dozens
        logging.getLogger("torch._dynamo.guards").setLevel(logging.ERROR)
    where = inductor_dir(cfg, world_size)
    keep_plans(None if where is None else where / PLANS)
    if where is None:
        return None
    where.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(where)
    os.environ["TRITON_CACHE_DIR"] = str(where.parent / "triton")
    return where


def inductor_dir(cfg: Config, world_size: int) -> Path | None:
    """Inductor's cache directory for this run's key (module notes), or None for inductor's own
    default (no directory given, no ``$FASTTRAIN_CACHE`` and no trace kept)."""
    managed = cfg.train.compile_cache is not None or "FASTTRAIN_CACHE" in os.environ
    if not (managed or trace_cache_applies(cfg, world_size)):
        return None
    return compile_root(cfg) / key(cfg, world_size)


def compile_root(cfg: Config) -> Path:
    """The compile caches' directory where fasttrain places them: ``--compile-cache``, else
    ``$FASTTRAIN_CACHE/compile`` or ``~/.cache/fasttrain/compile``."""
    given = cfg.train.compile_cache
    return Path(given).expanduser() if given else cache_dir() / "compile"


def trace_cache_applies(cfg: Config, world_size: int) -> bool:
    """``--trace-cache``, where one process trains with shapes fixed for the whole run (module
    notes)."""
    return cfg.train.trace_cache and why_no_trace(cfg, world_size) is None


def why_no_trace(cfg: Config, world_size: int) -> str | None:
    """Why dynamo's trace is not kept for this run whatever ``--trace-cache`` says, or None."""
    t = cfg.train
    if world_size > 1:
        return "dynamo's trace is kept for one process only"
    if t.batch_size is None or t.batch_sizes or cfg.data.progressive_resizing:
        return (
            "dynamo's trace is not kept where the step's shapes change within the run "
            "(--batch-size auto, --batch-sizes, --progressive-resizing)"
        )
    return None


def key(cfg: Config, world_size: int) -> str:
    """What the compiled step depends on (module notes), hashed."""
    t, m = cfg.train, cfg.model
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = None
    if t.device == "cuda" and torch.cuda.is_available():
        device = [torch.cuda.get_device_name(), list(torch.cuda.get_device_capability())]
    what = {
        "torch": torch.__version__,
        "triton": triton_version,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": device or t.device,
        # DDP's graphs, split at its buckets (their size is in "train"), whatever the number
        # of ranks: a job of 2 and one of 64 on the same flags compile the same graphs
        "ddp": world_size > 1,
        "model": [m.arch, m.num_classes, m.channels_last, m.fused_bn, m.cudnn_bn],
        # the loader sets the input's type (DALI's fp16, torchvision's fp32); val's crop, the
        # evaluation's compiled shape
        "data": [cfg.data.image_size, cfg.data.progressive_resizing, cfg.data.loader,
                 cfg.data.val_crop_size],
        "train": [t.batch_size, t.batch_sizes, t.accum_steps, t.amp, t.compile_mode,
                  t.inductor_options, t.cuda_graphs, t.triton_kernels, t.strategy,
                  t.model_ema, t.mixup_alpha, t.cutmix_alpha, t.random_erase, t.deterministic,
                  t.bucket_cap_mb, t.sync_bn],
        "loss": [cfg.optim.label_smoothing],
    }  # fmt: skip
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Artifacts:
    """A run folder's saved compile artifacts for this run's key (module notes).

    A start that loads dynamo's trace compiles nothing, so torch records nothing of the graphs
    it runs and its own artifacts would hold only what it compiled later. So the run that
    compiled also keeps its artifacts in inductor's folder for the key (``artifacts.bin``), and
    a run that started from the trace keeps a copy of those, where they hold more."""

    def __init__(self, run_dir: Path | None, cfg: Config, world_size: int, is_main: bool):
        # None: no run folder (``fasttrain compile``), only the key's shared file
        folder = Path(run_dir) / FOLDER if run_dir else None
        self.path = folder / f"{key(cfg, world_size)}.bin" if folder else None
        # the Triton kernels the step's launchers run (``kernels_kept.py``)
        self.kernels = folder / f"{key(cfg, world_size)}{KERNELS}" if folder else None
        managed = inductor_dir(cfg, world_size)  # None: inductor's own default
        where = managed if trace_cache_applies(cfg, world_size) else None
        self.shared = where / SHARED if where is not None else None
        self.enabled = cfg.train.compile
        self.is_main = is_main
        self.saved_size = 0
        self.saved_after: dict[str, float] | None = None  # torch's compile records then
        self.kernels_seen: set[str] | None = None  # the launchers' kernels then
        self.kernels_saved: set[str] = set()
        # CUDA's JIT cache, in the run's folder and the compile caches' directory (jit_kept.py),
        # for every job that places its caches there, DDP's included
        root = compile_root(cfg) if managed is not None else None
        self.jit = JitKept(places(folder, root), os.environ, is_main)

    def load(self) -> bool:
        """Fill the compile caches from the folder's artifacts, if there are any for this key:
        Triton's with the kept kernels it lacks, then torch's."""
        if not self.enabled or self.path is None or not self.path.is_file():
            return False
        self._load_kernels()
        data = self.path.read_bytes()
        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as e:  # damaged, or from a torch that writes another format
            log.warning("compile artifacts %s not loaded (%s): compiling afresh", self.path, e)
            return False
        entries = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
        log.info(
            "loaded %d compile cache entries from %s (this folder's earlier run)",
            entries,
            self.path,
        )
        # a start that loads them records less than it loaded (not what it found in the caches):
        # the folder's file is replaced only by more, and the key's file on this machine, which
        # the next run that starts from the trace copies, starts with them
        self.saved_size = len(data)
        if self.shared is not None and (
            not self.shared.is_file() or self.shared.stat().st_size < len(data)
        ):
            write_whole(self.shared, data)
        return True

    def save(self) -> None:
        """Save what this process has compiled, or the key's artifacts where those hold more
        (class notes), where it is more than the file holds, and the kernels the launchers run
        (main process); nothing when nothing was compiled or tuned since the last call (a
        checkpoint)."""
        if not (self.enabled and self.is_main):
            return
        self.jit.save()  # cuDNN's kernels the driver compiled, grown or not with the rest
        compiled = compile_totals()
        kernels = launched_kernels()  # tuning changes these, and compiles nothing torch records
        if compiled == self.saved_after and kernels == self.kernels_seen:
            return
        self.saved_after, self.kernels_seen = compiled, kernels
        self._save_kernels(kernels)
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as e:
            log.debug("compile artifacts not saved: %s", e)
            return
        data = saved[0] if saved is not None else b""
        shared = self.shared.read_bytes() if self.shared and self.shared.is_file() else b""
        if len(data) > len(shared) and self.shared is not None:
            write_whole(self.shared, data)
        best = max(data, shared, key=len)
        if self.path is None or len(best) <= self.saved_size:
            return
        write_whole(self.path, best)
        self.saved_size = len(best)
        log.debug("saved %.1f MB of compile artifacts to %s", len(best) / 2**20, self.path)

    def _load_kernels(self) -> None:
        if self.kernels is None or not self.kernels.is_file():
            return
        where = triton_dir()
        try:
            added, self.kernels_saved = unpack(self.kernels.read_bytes(), where)
        except (OSError, ValueError, tarfile.TarError) as e:
            log.warning("kept kernels %s not loaded (%s): they compile again", self.kernels, e)
            return
        if added:
            log.info("put %d kept Triton kernels from %s into %s", added, self.kernels, where)

    def _save_kernels(self, kernels: set[str]) -> None:
        if self.kernels is None or kernels <= self.kernels_saved:
            return
        try:
            data, found = pack(kernels, triton_dir())
        except OSError as e:
            log.debug("kernels not kept: %s", e)
            return
        if found - self.kernels_saved:
            write_whole(self.kernels, data)
            self.kernels_saved = found
            log.debug("kept %d Triton kernels in %s", len(found), self.kernels)
