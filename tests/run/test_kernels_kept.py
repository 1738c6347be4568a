"""The Triton kernels a run's launchers run, kept with its compile artifacts
(``run/kernels_kept.py``): on the CPU, with a Triton cache of stand-in folders, since the CPU's
compiled code has no Triton kernels."""

from __future__ import annotations

import io
import shutil
import tarfile
import types
from pathlib import Path

import pytest
import torch

from fasttrain.run import compile_cache, kernels_kept
from fasttrain.run.kernels_kept import launched_kernels, pack, unpack


def cache_with(where: Path, *keys: str) -> Path:
    """A Triton cache with a folder per key, each holding two files that name it."""
    for k in keys:
        (where / k).mkdir(parents=True)
        (where / k / f"{k}.cubin").write_bytes(f"binary of {k}".encode())
        (where / k / f"__grp__{k}.json").write_text(f'{{"kernel": "{k}"}}')
    return where


def files(where: Path) -> dict[str, bytes]:
    return {str(p.relative_to(where)): p.read_bytes() for p in where.rglob("*") if p.is_file()}


def test_packed_folders_fill_an_empty_cache_and_leave_present_ones_alone(tmp_path):
    a = cache_with(tmp_path / "a", "k1", "k2", "k3")
    data, found = pack({"k1", "k2", "gone"}, a)
    assert found == {"k1", "k2"}  # a folder no longer there is left out

    b = tmp_path / "b"
    assert unpack(data, b) == (2, {"k1", "k2"})
    assert files(b) == {k: v for k, v in files(a).items() if not k.startswith("k3")}
    assert unpack(data, b) == (0, {"k1", "k2"})  # all there already

    c = cache_with(tmp_path / "c", "k1")
    (c / "k1" / "k1.cubin").write_bytes(b"this machine's own")
    assert unpack(data, c)[0] == 1  # k2 only: k1 is this machine's, left as it is
    assert (c / "k1" / "k1.cubin").read_bytes() == b"this machine's own"
    assert (c / "k2" / "k2.cubin").read_bytes() == b"binary of k2"
    assert not [p for p in c.iterdir() if p.name.startswith(".")]  # no temporary left


def test_triton_finds_a_kept_kernel_on_a_new_machine_with_the_first_cache_gone(
    tmp_path, monkeypatch
):
    """Triton's group file names a kernel's files by absolute path. Packed on one machine and
    put into another's cache, the kernel is a hit for Triton's own cache manager there once the
    first cache is gone; and the same files with the group left as packed miss."""
    cache = pytest.importorskip("triton.runtime.cache")
    a, b = tmp_path / "a", tmp_path / "b"
    key = "ABCDEFGHIJKLMNOP"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(a))
    compiled = cache.FileCacheManager(key)
    group = {
        name: compiled.put(data, name)
        for name, data in (("k.cubin", b"\x7fELF binary"), ("k.json", '{"name": "k"}'))
    }
    compiled.put_group("k.json", group)
    assert compiled.get_group("k.json") == group  # a hit on the machine that compiled
    data, found = pack({key}, a)
    assert found == {key}
    shutil.rmtree(a)

    assert unpack(data, b) == (1, {key})
    monkeypatch.setenv("TRITON_CACHE_DIR", str(b))
    hit = cache.FileCacheManager(key).get_group("k.json")
    assert hit is not None and set(hit) == {"k.cubin", "k.json"}
    assert all(Path(p).parent == b / key and Path(p).is_file() for p in hit.values())
    assert Path(hit["k.cubin"]).read_bytes() == b"\x7fELF binary"

    as_packed = tmp_path / "c"  # the tar's files written as they are: Triton misses
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(as_packed, filter="data")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(as_packed))
    assert cache.FileCacheManager(key).get_group("k.json") is None


@pytest.mark.parametrize("name", ["../evil", "k1/../../evil", "deep/er/file", "/abs", "lone"])
def test_a_member_outside_a_kernel_folder_is_refused_and_nothing_is_written(tmp_path, name):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(ValueError, match="unexpected member"):
        unpack(buffer.getvalue(), tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_a_link_in_the_packed_kernels_is_refused(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("k1/k1.cubin")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(ValueError, match="unexpected member"):
        unpack(buffer.getvalue(), tmp_path)


def test_the_launchers_kernels_are_found_in_inductor_s_loaded_modules(monkeypatch):
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def autotuner(*keys: str) -> CachingAutotuner:
        kernel = CachingAutotuner.__new__(CachingAutotuner)  # no compile: its launchers alone
        kernel.launchers = [types.SimpleNamespace(cache_hash=k) for k in keys]
        return kernel

    module = types.ModuleType("generated")
    module.triton_poi_fused_0 = autotuner("tuned0")  # type: ignore[attr-defined]
    module.triton_red_fused_1 = autotuner("start1a", "start1b")  # type: ignore[attr-defined]
    module.not_a_kernel = types.SimpleNamespace(launchers=[types.SimpleNamespace(cache_hash="x")])  # type: ignore[attr-defined]
    monkeypatch.setattr(PyCodeCache, "modules", [module])
    assert launched_kernels() == {"tuned0", "start1a", "start1b"}


def test_a_run_keeps_its_kernels_and_a_start_on_a_new_machine_puts_them_back(tmp_path, monkeypatch):
    """Saved with the artifacts; saved again when tuning changed the launchers, though torch's
    compile records did not change; loaded into a new machine's empty Triton cache."""
    from fasttrain.config.cli import parse_args

    cfg = parse_args(
        ["--data", "/d", "--compile", "--compile-cache", str(tmp_path / "inductor")],
        cuda_available=False,
    )[0]
    machine_a = cache_with(tmp_path / "triton-a", "start", "tuned", "unused")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(machine_a))
    running = {"start"}
    monkeypatch.setattr(compile_cache, "launched_kernels", lambda: set(running))
    monkeypatch.setattr(compile_cache, "compile_totals", lambda: {"inductor": 1.0})
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"torch's", None))

    run = tmp_path / "run"
    artifacts = compile_cache.Artifacts(run, cfg, 1, is_main=True)
    artifacts.save()  # after the first step
    assert artifacts.path is not None and artifacts.path.read_bytes() == b"torch's"
    kept = artifacts.kernels
    assert kept is not None and kept.name.endswith(".triton.tar.gz")
    first = kept.read_bytes()

    artifacts.save()  # a checkpoint, nothing new: the file stays as it is
    assert kept.read_bytes() == first
    running.clear()
    running.add("tuned")  # the tuning step: new launchers, no new compile record
    artifacts.save()

    machine_b = tmp_path / "triton-b"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(machine_b))
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    assert compile_cache.Artifacts(run, cfg, 1, is_main=True).load()
    assert loaded == [b"torch's"]
    assert files(machine_b) == {k: v for k, v in files(machine_a).items() if "tuned" in k}


def test_damaged_kept_kernels_are_warned_about_and_the_artifacts_still_load(
    tmp_path, monkeypatch, caplog
):
    from fasttrain.config.cli import parse_args

    cfg = parse_args(["--data", "/d", "--compile"], cuda_available=False)[0]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    artifacts = compile_cache.Artifacts(tmp_path / "run", cfg, 1, is_main=True)
    assert artifacts.path is not None and artifacts.kernels is not None
    artifacts.path.parent.mkdir(parents=True)
    artifacts.path.write_bytes(b"torch's")
    artifacts.kernels.write_bytes(b"not a tar")
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    with caplog.at_level("WARNING", logger="fasttrain"):
        assert artifacts.load()
    assert loaded == [b"torch's"]
    assert "kept kernels" in caplog.text and "compile again" in caplog.text


def test_without_a_triton_cache_dir_the_folder_is_inductor_s_for_device_0(monkeypatch):
    from torch._inductor.runtime.runtime_utils import triton_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert kernels_kept.triton_dir() == Path(triton_cache_dir(0))
