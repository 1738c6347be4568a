"""The warm-start fixes for coordinate-descent tuning: the backport of pytorch/pytorch#172819,
against a stand-in for torch 2.11's method (the test machine's torch already has the fix), and
Triton configs that keep coordinate descent's mark through a pickle (Triton's own ``Config``);
and the ``ptxas`` shared with inductor's compile workers."""

import copy
import pickle
from types import SimpleNamespace

import pytest

th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
triton = pytest.importorskip("triton")

from fasttrain.step import torch_fixes  # noqa: E402


def buggy_recheck(self, reload_kernel_from_src):
    """torch 2.11's logic, cut down: narrows to the cached best config only when there were
    several, and never carries over found_by_coordesc."""
    configs = [result.config for result in self.compile_results]
    cached, _, _ = th.check_autotune_cache(configs, self.filename, self.inductor_meta)
    if len(cached) == 1 and len(configs) > 1:
        key = th.triton_config_to_hashable(cached[0])
        for result in self.compile_results:
            if th.triton_config_to_hashable(result.config) == key:
                self.compile_results = [result]
                return


def config(block: int, coordesc: bool | None = None) -> "triton.Config":
    c = triton.Config({"XBLOCK": block}, num_warps=4)
    if coordesc is not None:
        c.found_by_coordesc = coordesc
    return c


@pytest.fixture
def patched(monkeypatch):
    """Install the stand-in and a cache that answers ``best``; then apply the fix."""
    monkeypatch.setattr(th.CachingAutotuner, "recheck_autotune_cache", buggy_recheck)
    cache = {}
    monkeypatch.setattr(th, "check_autotune_cache", lambda *a, **k: (cache["best"], None, None))
    assert torch_fixes.keep_coordinate_descent_results()
    assert not torch_fixes.keep_coordinate_descent_results()  # once only
    return cache


def kernel(*blocks: int, compiled: list | None = None):
    k = SimpleNamespace(
        compile_results=[SimpleNamespace(config=config(b)) for b in blocks],
        filename="k.py",
        inductor_meta={},
        fn=SimpleNamespace(fn=object()),
    )
    k._precompile_config = lambda c: (
        (compiled.append(c) if compiled is not None else None) or (SimpleNamespace(config=c))
    )
    return k


@pytest.mark.parametrize("blocks", [(64,), (32, 64, 128)], ids=["one-config", "several"])
def test_a_cached_coordinate_descent_result_is_marked_found(patched, blocks):
    patched["best"] = [config(64, coordesc=True)]
    k = kernel(*blocks)
    th.CachingAutotuner.recheck_autotune_cache(k, None)
    assert [r.config.kwargs["XBLOCK"] for r in k.compile_results] == [64]
    assert k.compile_results[0].config.found_by_coordesc is True  # run() then does not re-tune


def test_a_tuned_config_the_kernel_was_not_compiled_with_is_compiled(patched):
    patched["best"] = [config(256, coordesc=True)]
    compiled = []
    k = kernel(64, compiled=compiled)
    th.CachingAutotuner.recheck_autotune_cache(k, None)
    assert [c.kwargs["XBLOCK"] for c in compiled] == [256]
    assert k.compile_results[0].config.kwargs["XBLOCK"] == 256


@pytest.mark.parametrize("best", [[], [config(64, coordesc=False)]], ids=["miss", "not-tuned"])
def test_without_a_tuned_cache_entry_the_original_decides(patched, best):
    patched["best"] = best
    k = kernel(32, 64)
    before = list(k.compile_results)
    th.CachingAutotuner.recheck_autotune_cache(k, None)
    expected = before if not best else [before[1]]
    assert k.compile_results == expected
    assert not getattr(k.compile_results[0].config, "found_by_coordesc", False)


def test_a_torch_with_the_fix_is_left_alone(monkeypatch):
    def fixed(self, reload_kernel_from_src):
        pass

    monkeypatch.setattr(th.CachingAutotuner, "recheck_autotune_cache", fixed)
    assert not torch_fixes.keep_coordinate_descent_results()
    assert th.CachingAutotuner.recheck_autotune_cache is fixed


class LosesTheMark:
    """A config whose ``__setstate__`` restores its own fields only, as Triton's does."""

    def __init__(self, kwargs):
        self.kwargs = kwargs

    def __setstate__(self, state):
        self.kwargs = state.get("kwargs", {})


class KeepsTheMark:
    """A config that pickles with its whole ``__dict__`` (no ``__setstate__``)."""

    def __init__(self, kwargs):
        self.kwargs = kwargs


def round_trips(config_cls):
    """What a compile worker's result and a copy of a kernel do to a marked config."""
    c = config_cls({"XBLOCK": 64})
    c.found_by_coordesc = True
    sent = pickle.loads(pickle.dumps(SimpleNamespace(config=c))).config  # a worker's result
    return sent, copy.deepcopy(c)


def test_a_pickled_or_copied_config_keeps_coordinate_descent_s_mark(monkeypatch):
    monkeypatch.setattr(triton, "Config", LosesTheMark)
    monkeypatch.setattr(LosesTheMark, "__setstate__", LosesTheMark.__setstate__)  # restored
    assert not any(getattr(c, "found_by_coordesc", False) for c in round_trips(LosesTheMark))
    assert torch_fixes.keep_coordinate_descent_mark_in_copies()
    assert not torch_fixes.keep_coordinate_descent_mark_in_copies()  # once only
    for c in round_trips(LosesTheMark):
        assert c.found_by_coordesc is True and c.kwargs == {"XBLOCK": 64}
    unmarked = pickle.loads(pickle.dumps(LosesTheMark({"XBLOCK": 8})))
    assert not hasattr(unmarked, "found_by_coordesc")  # nothing added where nothing was


def test_a_config_that_keeps_the_mark_is_left_alone(monkeypatch):
    monkeypatch.setattr(triton, "Config", KeepsTheMark)
    assert not torch_fixes.keep_coordinate_descent_mark_in_copies()
    assert "__setstate__" not in KeepsTheMark.__dict__


def test_triton_s_config_keeps_the_mark_once_fixed(monkeypatch):
    """Triton's own ``Config``, as inductor's workers send it back."""
    cls = triton.Config
    if "__setstate__" in cls.__dict__:  # else its pickles keep every attribute
        monkeypatch.setattr(cls, "__setstate__", cls.__dict__["__setstate__"])  # restored
    torch_fixes.keep_coordinate_descent_mark_in_copies()
    for c in round_trips(lambda kwargs: cls(kwargs, num_warps=8)):
        assert c.found_by_coordesc is True and c.num_warps == 8


@pytest.fixture
def torch_tree(tmp_path, monkeypatch):
    """inductor's compile tasks as if installed in ``tmp_path/torch``, where a torch that ships
    ``ptxas`` has it (``bin/ptxas``); TRITON_PTXAS_PATH unset, and torch's one-time setter reset."""
    from torch._inductor.runtime import compile_tasks

    runtime = tmp_path / "torch" / "_inductor" / "runtime"
    runtime.mkdir(parents=True)
    monkeypatch.setattr(compile_tasks, "__file__", str(runtime / "compile_tasks.py"))
    monkeypatch.delenv(torch_fixes.PTXAS, raising=False)
    reset = getattr(compile_tasks._set_triton_ptxas_path, "cache_clear", lambda: None)
    reset()
    yield tmp_path / "torch"
    reset()


def test_the_training_process_takes_the_ptxas_torch_ships(torch_tree, monkeypatch):
    import os

    ptxas = torch_tree / "bin" / "ptxas"
    ptxas.parent.mkdir()
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    assert torch_fixes.share_ptxas_with_compile_workers()
    assert os.environ[torch_fixes.PTXAS] == str(ptxas)  # what inductor's workers set
    assert not torch_fixes.share_ptxas_with_compile_workers()  # set: nothing more to do


def test_a_users_ptxas_or_a_torch_without_one_is_left_as_it_is(torch_tree, monkeypatch):
    import os

    assert not torch_fixes.share_ptxas_with_compile_workers()  # no bin/ptxas: Triton's own
    assert torch_fixes.PTXAS not in os.environ
    (torch_tree / "bin").mkdir()
    (torch_tree / "bin" / "ptxas").write_text("#!/bin/sh\n")
    (torch_tree / "bin" / "ptxas").chmod(0o755)
    monkeypatch.setenv(torch_fixes.PTXAS, "/opt/cuda/bin/ptxas")
    assert not torch_fixes.share_ptxas_with_compile_workers()
    assert os.environ[torch_fixes.PTXAS] == "/opt/cuda/bin/ptxas"


# a loaded kernel's tuned config, looked up in this process's cache (torch's own code)


@pytest.fixture
def two_caches(tmp_path, monkeypatch):
    """Inductor's cache ``a`` (where a kernel compiled and was tuned) and ``b`` (this process's),
    torch's own unfixed ``recheck_autotune_cache`` installed, the artifact records cleared."""
    import inspect

    from torch.compiler._cache import CacheArtifactManager

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # it turns the autotune cache off
    unfixed = inspect.unwrap(th.CachingAutotuner.recheck_autotune_cache)
    monkeypatch.setattr(th.CachingAutotuner, "recheck_autotune_cache", unfixed)
    CacheArtifactManager.clear()
    yield tmp_path / "a", tmp_path / "b"
    CacheArtifactManager.clear()


META = {"coordinate_descent_tuning": True}
CONFIGS = (32, 64, 128)


def tune(cache, monkeypatch, block: int) -> str:
    """Save ``block`` as the tuned config of a kernel compiled in ``cache``; its source path."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    source = str(cache / "ab" / "cabkernel.py")
    configs = [config(b) for b in CONFIGS]
    AutotuneCache.create(META, source, th.hash_configs(configs)).save(config(block), 1)
    return source


def loaded(source: str):
    """The kernel as inductor loads it from a cached graph: its compiled variants, and the
    source path it was compiled at."""
    return SimpleNamespace(
        compile_results=[SimpleNamespace(config=config(b)) for b in CONFIGS],
        filename=source,
        inductor_meta=META,
        is_statically_launchable=lambda: True,
        _could_rblock_scale=False,
        fn=SimpleNamespace(fn=object()),
        save_cache_hook=None,
    )


def blocks(kernel) -> list[int]:
    return [r.config.kwargs["XBLOCK"] for r in kernel.compile_results]


def test_a_kernel_from_another_machines_cache_finds_its_tuning_here(two_caches, monkeypatch):
    import shutil

    import torch

    a, b = two_caches
    source = tune(a, monkeypatch, 64)  # the machine that compiled and tuned
    data, _ = torch.compiler.save_cache_artifacts()  # a run folder's artifacts
    shutil.rmtree(a)  # a new machine: only the artifacts come along
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(b))
    torch.compiler.load_cache_artifacts(data)
    unfixed = loaded(source)
    th.CachingAutotuner.recheck_autotune_cache(unfixed, None)
    assert blocks(unfixed) == list(CONFIGS)  # torch looks beside the old path: not found
    assert torch_fixes.find_tuning_in_this_cache()
    assert not torch_fixes.find_tuning_in_this_cache()  # once only
    kernel = loaded(source)
    th.CachingAutotuner.recheck_autotune_cache(kernel, None)
    assert blocks(kernel) == [64]
    assert kernel.filename == str(b / "ab" / "cabkernel.py")


def test_tuning_found_nowhere_is_saved_where_the_next_start_looks(two_caches, monkeypatch):
    a, b = two_caches
    source = str(a / "ab" / "cabkernel.py")  # a's cache is gone, b has no tuned config
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(b))
    torch_fixes.find_tuning_in_this_cache()
    kernel = loaded(source)
    th.CachingAutotuner.recheck_autotune_cache(kernel, None)
    assert blocks(kernel) == list(CONFIGS)  # nothing to narrow to: the kernel is tuned
    kernel.save_cache_hook(config(128), 1, found_by_coordesc=True)  # as coordinate descent does
    assert not a.exists()
    again = loaded(source)
    th.CachingAutotuner.recheck_autotune_cache(again, None)
    assert blocks(again) == [128]


def test_tuning_where_the_kernel_compiled_is_still_found(two_caches, monkeypatch):
    """The same machine, its first cache still there and this one without the entry."""
    a, b = two_caches
    source = tune(a, monkeypatch, 32)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(b))
    torch_fixes.find_tuning_in_this_cache()
    kernel = loaded(source)
    th.CachingAutotuner.recheck_autotune_cache(kernel, None)
    assert blocks(kernel) == [32] and kernel.filename == source


def test_a_kernel_compiled_in_this_cache_keeps_its_path(tmp_path):
    source = str(tmp_path / "ab" / "cabkernel.py")
    assert torch_fixes.in_this_cache(source, str(tmp_path)) is None
    assert torch_fixes.in_this_cache(None, str(tmp_path)) is None
    moved = torch_fixes.in_this_cache("/elsewhere/cache/ab/cabkernel.py", str(tmp_path))
    assert moved == source
