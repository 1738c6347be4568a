"""CUDA's JIT cache kept with a run and in the compile caches' directory (``run/jit_kept.py``),
with stand-ins for the driver's ``/proc`` files and its cache folder."""

import io
import logging
import tarfile
from pathlib import Path

import pytest

from fasttrain.run import jit_kept
from fasttrain.run.jit_kept import JitKept, machine_key, pack, places, restore, unpack
from fasttrain.step import conv_warmup
from tests.conftest import FAST, start_as_compiled


def driver(root: Path, version: str = "580.159.04", models=("NVIDIA H100 80GB HBM3",)) -> Path:
    """A stand-in for ``/proc/driver/nvidia``."""
    (root / "gpus").mkdir(parents=True, exist_ok=True)
    (root / "version").write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}\n")
    for i, model in enumerate(models):
        (root / "gpus" / f"0000:0{i}:00.0").mkdir(exist_ok=True)
        (root / "gpus" / f"0000:0{i}:00.0" / "information").write_text(
            f"Model: \t\t {model}\nIRQ:   \t\t 42\n"
        )
    return root


def a_jit_cache(path: Path) -> dict[str, bytes]:
    """A stand-in for the driver's cache folder: an index and entries in sub-folders."""
    files = {"index": b"entries", "3/a1": b"sass for one kernel", "c/7f/b2": b"and another"}
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return files


def contents(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_the_machine_key_follows_the_driver_and_the_gpus(tmp_path):
    h100 = machine_key(driver(tmp_path / "a"))
    assert h100 is not None and h100 == machine_key(driver(tmp_path / "b"))
    assert machine_key(driver(tmp_path / "c", version="580.200.01")) != h100
    assert machine_key(driver(tmp_path / "d", models=("NVIDIA H200",))) != h100
    assert machine_key(tmp_path / "no-driver") is None
    assert places(Path("run"), Path("cache"), tmp_path / "no-driver") == []


def test_a_packed_cache_becomes_a_missing_or_empty_one_whole(tmp_path):
    files = a_jit_cache(tmp_path / "old")
    data = pack(tmp_path / "old")
    assert data is not None
    assert unpack(data, tmp_path / "new" / "ComputeCache") == len(files)  # missing, parent too
    assert contents(tmp_path / "new" / "ComputeCache") == files
    (tmp_path / "empty").mkdir()
    assert unpack(data, tmp_path / "empty") == len(files)
    assert contents(tmp_path / "empty") == files
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_cache_that_holds_anything_is_left_as_it_is(tmp_path):
    a_jit_cache(tmp_path / "old")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "index").write_bytes(b"this machine's")
    assert unpack(pack(tmp_path / "old"), tmp_path / "mine") == 0
    assert contents(tmp_path / "mine") == {"index": b"this machine's"}


def test_an_empty_or_too_large_cache_is_not_packed(tmp_path):
    assert pack(tmp_path / "missing") is None
    (tmp_path / "empty").mkdir()
    assert pack(tmp_path / "empty") is None
    a_jit_cache(tmp_path / "full")
    assert pack(tmp_path / "full", cap=10) is None
    assert pack(tmp_path / "full", cap=1000) is not None


@pytest.mark.parametrize("name", ["/etc/passwd", "../up", "a/../../up", "link"])
def test_members_outside_the_cache_or_not_plain_files_are_refused(tmp_path, name):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        member = tarfile.TarInfo(name)
        if name == "link":
            member.type, member.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(member)
        else:
            member.size = 1
            tar.addfile(member, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="unexpected member"):
        unpack(buffer.getvalue(), tmp_path / "cache")
    assert list(tmp_path.iterdir()) == []  # neither the cache nor a temporary folder


def test_a_start_takes_the_run_s_cache_first_then_the_compile_cache_s(tmp_path, caplog):
    proc = driver(tmp_path / "proc")
    kept = places(tmp_path / "run" / "compile-cache", tmp_path / "compile", proc)
    assert [p.parent for p in kept] == [tmp_path / "run" / "compile-cache",
                                        tmp_path / "compile" / "cuda-jit"]  # fmt: skip
    env = {"CUDA_CACHE_PATH": str(tmp_path / "jit")}
    assert restore(kept, env) is None  # nothing kept yet
    files = a_jit_cache(tmp_path / "other-machine")
    kept[1].parent.mkdir(parents=True)
    kept[1].write_bytes(pack(tmp_path / "other-machine"))
    kept[0].parent.mkdir(parents=True)
    kept[0].write_bytes(b"not a tar")  # damaged: said, and the next one taken
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        assert restore(kept, env) == kept[1]
    assert "not used" in caplog.text
    assert contents(tmp_path / "jit") == files
    assert not conv_warmup.jit_cache_empty(env)
    assert restore(kept, {"CUDA_CACHE_DISABLE": "1"}) is None
    assert (
        restore(kept, {"CUDA_CACHE_PATH": str(tmp_path / "jit2"), "FASTTRAIN_JIT_KEPT": "0"})
        is None
    )
    assert not (tmp_path / "jit2").exists()


def test_the_main_process_keeps_the_cache_when_it_grew(tmp_path):
    proc = driver(tmp_path / "proc")
    kept = places(tmp_path / "run" / "compile-cache", tmp_path / "compile", proc)
    env = {"CUDA_CACHE_PATH": str(tmp_path / "jit")}
    JitKept(kept, env, is_main=True).save()  # no cache yet: nothing to keep
    assert not any(p.exists() for p in kept)
    files = a_jit_cache(tmp_path / "jit")
    JitKept(kept, env, is_main=False).save()
    JitKept(kept, {**env, "FASTTRAIN_JIT_KEPT": "0"}, is_main=True).save()
    assert not any(p.exists() for p in kept)
    keeper = JitKept(kept, env, is_main=True)
    keeper.save()
    for place in kept:
        assert unpack(place.read_bytes(), tmp_path / place.name) == len(files)
    stamp = kept[0].stat().st_mtime_ns
    keeper.save()  # unchanged: not written again
    assert kept[0].stat().st_mtime_ns == stamp
    (tmp_path / "jit" / "9" / "new").parent.mkdir()
    (tmp_path / "jit" / "9" / "new").write_bytes(b"a kernel compiled since")
    keeper.save()
    assert unpack(kept[0].read_bytes(), tmp_path / "again") == len(files) + 1


def test_a_run_on_an_empty_machine_starts_with_its_folder_s_cache_before_any_cuda_work(
    run, tiny_data, tmp_path, monkeypatch
):
    """The wiring: the cache is put back before the settings' resolution (where a GPU's
    start and cuDNN's probe run), and the convolutions' thread is told the cache was full."""
    monkeypatch.setattr(jit_kept, "DRIVER", driver(tmp_path / "proc"))
    jit_cache = tmp_path / "jit-cache"
    monkeypatch.setenv("CUDA_CACHE_PATH", str(jit_cache))
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    files = a_jit_cache(tmp_path / "where-it-ran")
    kept = places(tmp_path / "run" / "compile-cache", None)[0]
    kept.parent.mkdir(parents=True)
    kept.write_bytes(pack(tmp_path / "where-it-ran"))
    events = []

    def start(model, amp_dtype, shape, channels_last, env, fresh_jit_cache):
        events.append(("convs ahead, fresh JIT cache", fresh_jit_cache))

    start_as_compiled(
        monkeypatch, start, lambda: events.append(("resolve", contents(jit_cache) == files))
    )
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "2", "--eval-every", "0",
                    "--output-dir", tmp_path / "run")  # fmt: skip
    assert code == 0, err
    assert events == [("resolve", True), ("convs ahead, fresh JIT cache", False)]
    assert "CUDA's JIT cache: this machine's was empty" in err


def test_a_compiled_run_s_saves_keep_the_cache_in_its_folder_and_the_compile_caches(
    tmp_path, monkeypatch
):
    """``compile_cache.Artifacts.save`` (after the first step, at checkpoints, at the end) keeps
    the JIT cache too, where fasttrain places the compile caches."""
    import torch

    from fasttrain.config.cli import parse_args
    from fasttrain.run import compile_cache

    monkeypatch.setattr(jit_kept, "DRIVER", driver(tmp_path / "proc"))
    monkeypatch.setenv("CUDA_CACHE_PATH", str(tmp_path / "jit"))
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"", None))
    files = a_jit_cache(tmp_path / "jit")
    argv = ["--data", "/d", "--compile", "--compile-cache", str(tmp_path / "compile")]
    cfg = parse_args(argv, cuda_available=False)[0]
    for world_size in (1, 2):  # a DDP job keeps no trace, and keeps the JIT cache all the same
        for place in places(tmp_path / "run" / "compile-cache", tmp_path / "compile"):
            place.unlink(missing_ok=True)
        compile_cache.Artifacts(tmp_path / "run", cfg, world_size, is_main=True).save()
        for place in places(tmp_path / "run" / "compile-cache", tmp_path / "compile"):
            assert unpack(place.read_bytes(), tmp_path / f"{place.name}{world_size}") == len(files)


def test_a_cache_that_changes_while_it_is_read_skips_a_save_and_is_kept_later(
    tmp_path, monkeypatch
):
    """The driver writes its cache beside the run: a file gone between the listing and its
    read fails that save only, not the run, and the next save keeps the cache."""
    kept = places(tmp_path / "run" / "compile-cache", None, driver(tmp_path / "proc"))
    env = {"CUDA_CACHE_PATH": str(tmp_path / "jit")}
    files = a_jit_cache(tmp_path / "jit")
    keeper = JitKept(kept, env, is_main=True)
    real_pack = jit_kept.pack

    def vanished(cache, cap=jit_kept.CAP, files=None):
        raise FileNotFoundError(cache / "3" / "a1")

    monkeypatch.setattr(jit_kept, "pack", vanished)
    keeper.save()
    assert not kept[0].exists()
    monkeypatch.setattr(jit_kept, "pack", real_pack)
    keeper.save()
    assert unpack(kept[0].read_bytes(), tmp_path / "copy") == len(files)
