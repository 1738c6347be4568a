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
