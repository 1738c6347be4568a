"""Fixes for torch and Triton bugs that fasttrain's defaults depend on, upstream's where there is
one. Each is applied only where the installed torch or Triton still has the bug, judged from the
code it runs, not from a version number."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import pickle
from typing import Any

log = logging.getLogger("fasttrain")

BUGGY_RECHECK = "len(configs) > 1"  # the guard pytorch/pytorch#172819 names
PTXAS = "TRITON_PTXAS_PATH"


def torch_recheck(applied: str) -> tuple[Any, Any] | None:
    """Inductor's Triton runtime and its ``CachingAutotuner.recheck_autotune_cache``, which
    the fixes below wrap; None on a torch without them, or where the method already carries
    the fix marked ``applied``."""
    try:
        from torch._inductor.runtime import triton_heuristics as th
    except ImportError:  # a torch without inductor's Triton runtime: nothing to fix
        return None
    original = getattr(th.CachingAutotuner, "recheck_autotune_cache", None)
    if original is None or getattr(original, applied, False):
        return None
    return th, original


def keep_coordinate_descent_results() -> bool:
    """Make a warm start reuse coordinate-descent tuning instead of running it again.

    pytorch/pytorch#172819 (torch 2.11): when inductor loads a Triton kernel
    from its cache, it narrows the kernel to the cached best config but does not carry over the
    mark that coordinate descent found it, and skips kernels with one config altogether; the
    first call then tunes each kernel again. fasttrain's ``--compile-mode auto`` turns the
    tuning on, so a warm start took 42-74 s instead of seconds (BENCHMARKS.md). This wraps
    ``CachingAutotuner.recheck_autotune_cache`` to set the mark from the cache, as the fixed
    torch does. Returns whether it was applied (False on a torch without the bug).
    """
    found = torch_recheck("fasttrain_fix")
    if found is None:
        return False
    th, original = found
    try:
        if BUGGY_RECHECK not in inspect.getsource(original):
            return False
    except (OSError, TypeError):
        return False

    def recheck_autotune_cache(self: Any, reload_kernel_from_src: Any) -> None:
        configs = [result.config for result in self.compile_results]
        original(self, reload_kernel_from_src)
        cached, _, _ = th.check_autotune_cache(configs, self.filename, self.inductor_meta)
        if len(cached) != 1 or not getattr(cached[0], "found_by_coordesc", False):
            return
        best = cached[0]
        key = th.triton_config_to_hashable(best)
        for result in self.compile_results:
            if th.triton_config_to_hashable(result.config) == key:
                result.config.found_by_coordesc = True
                self.compile_results = [result]
                return
        # a kernel compiled with one config, for which coordinate descent found another: compile
        # that one now, as the original does when there were several
        if self.fn.fn is None:
            self.fn = reload_kernel_from_src().fn
        self.compile_results = [self._precompile_config(best)]

    recheck_autotune_cache.fasttrain_fix = True  # type: ignore[attr-defined]
    th.CachingAutotuner.recheck_autotune_cache = recheck_autotune_cache
    log.debug("torch fix applied: warm starts keep coordinate-descent results (#172819)")
    return True


def keep_coordinate_descent_mark_in_copies() -> bool:
    """Keep the mark that coordinate descent found a Triton config when the config is pickled or
    copied, so that a kernel compiled in one of inductor's compile workers is not tuned again.

    Inductor marks a config read from its autotune cache as coordinate descent's result
    (``found_by_coordesc``, an attribute Triton's ``Config`` does not declare), and its first
    call tunes any kernel whose config lacks the mark. Triton's ``Config.__setstate__`` (3.6 to
    3.8 at least) restores only its own fields. So a warm kernel that inductor compiles in a
    worker, rather than loading it with its compiled variants (the usual warm path, which
    ``keep_coordinate_descent_results`` covers), comes back to the training process without
    the mark and is tuned again from its cached best config: minutes for ResNet-50. This wraps
    ``Config.__setstate__`` to restore the mark. Applied only where a pickled config loses it;
    returns whether it was applied."""
    try:
        import triton
    except ImportError:  # no Triton: no kernels to tune
        return False
    config_cls = triton.Config
    original = config_cls.__dict__.get("__setstate__")
    if original is None or getattr(original, "fasttrain_fix", False):
        return False
    probe = config_cls({})
    probe.found_by_coordesc = True
    if getattr(pickle.loads(pickle.dumps(probe)), "found_by_coordesc", False):
        return False

    def __setstate__(self: Any, state: Any) -> None:
        original(self, state)
        if isinstance(state, dict) and state.get("found_by_coordesc"):
            self.found_by_coordesc = True

    __setstate__.fasttrain_fix = True  # type: ignore[attr-defined]
    config_cls.__setstate__ = __setstate__
    log.debug("torch fix applied: Triton configs keep coordinate descent's mark when copied")
    return True


def find_tuning_in_this_cache() -> bool:
    """Look a loaded Triton kernel's tuned config up in this process's inductor cache, not in
    the cache of the process that compiled it.

    Inductor loads a cached graph's kernels with their compiled variants as pickled
    ``CachingAutotuner`` objects, whose ``filename`` is the kernel's source path in the
    compiling process's cache. ``recheck_autotune_cache`` reads the tuned config beside that
    path, and coordinate descent saves its result there (torch 2.11 to 2.14 at least). torch's
    portable artifacts (``load_cache_artifacts``) put the tuned configs into this process's
    cache, under the same two last path parts. So a start whose caches came from elsewhere (a
    run's artifacts resumed on a new machine, a cache copied or mounted at another path) found
    no tuned config, tuned every kernel again (minutes for ResNet-50) and saved the results
    where no later start looked; on the machine that compiled, the old path still answered.
    This points a kernel at this process's cache where the tuned config is there, or where
    neither place has one (so that the tuning saves where the next start reads), before torch's
    lookup. Returns whether it was applied (once per process)."""
    found = torch_recheck("fasttrain_this_cache")
    if found is None:
        return False
    th, original = found
    from torch._inductor.runtime.runtime_utils import cache_dir

    @functools.wraps(original)
    def recheck_autotune_cache(self: Any, reload_kernel_from_src: Any) -> None:
        here = in_this_cache(self.filename, cache_dir())
        if here is not None:
            configs = [result.config for result in self.compile_results]
            meta = self.inductor_meta
            _, cache, info = th.check_autotune_cache(configs, here, meta)
            if hit(info) or not hit(th.check_autotune_cache(configs, self.filename, meta)[2]):
                self.filename = here
                if cache is not None:  # coordinate descent's result saved here too
                    self.save_cache_hook = cache.save
        original(self, reload_kernel_from_src)

    recheck_autotune_cache.fasttrain_this_cache = True  # type: ignore[attr-defined]
    th.CachingAutotuner.recheck_autotune_cache = recheck_autotune_cache
    log.debug("torch fix applied: loaded kernels find their tuning in this process's cache")
    return True


def in_this_cache(filename: str | None, root: str) -> str | None:
    """Where a kernel's source at ``filename`` (``<cache>/<aa>/<hash>.py``) lies in the cache
    at ``root``; None where it already lies there, or is unknown."""
    if not filename:
        return None
    folder, name = os.path.split(os.path.abspath(filename))
    if os.path.dirname(folder) == os.path.abspath(root):
        return None
    return os.path.join(os.path.abspath(root), os.path.basename(folder), name)


def hit(info: Any) -> bool:
    """Whether ``check_autotune_cache``'s information says it found a tuned config."""
    return isinstance(info, dict) and info.get("autotune_cache_state") == "hit"


def share_ptxas_with_compile_workers() -> bool:
    """Make the training process compile Triton kernels with the ``ptxas`` inductor's compile
    workers use, so that the two find each other's kernels in Triton's cache.

    A torch that ships its own ``ptxas`` (``torch/bin/ptxas``, torch 2.11's CUDA 13 wheels) has
    its compile workers point Triton at it (``TRITON_PTXAS_PATH``), but not the training process,
    which uses Triton's own. Triton's cache key holds the ``ptxas`` version, so each compile in
    the training process missed every kernel the workers had compiled: coordinate descent's
    compile of each kernel's starting configuration and of every candidate, and the compile of a
    warm start's tuned configuration. This points the training process at the same ``ptxas``,
    as torch does where it compiles without workers. A ``TRITON_PTXAS_PATH`` already set is left
    alone (the workers inherit it). Call it before anything is compiled: Triton keeps the first
    ``ptxas`` version it reads. Returns whether it set the path."""
    if os.environ.get(PTXAS) is not None:
        return False
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # a torch without inductor's compile workers: nothing to share
        return False
    _set_triton_ptxas_path()
    if os.environ.get(PTXAS) is None:  # torch ships no ptxas: both use Triton's
        return False
    log.debug("torch fix applied: ptxas shared with the compile workers (%s)", os.environ[PTXAS])
    return True
