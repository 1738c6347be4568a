"""fasttrain keeps torch's bytecode in its cache where Python would compile torch's source at
every start, and leaves Python alone elsewhere."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain import pycache

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package without bytecode, importable from ``tmp_path/src``."""
    src = tmp_path / "src" / "slowpkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    return src


def test_missing_only_where_python_would_not_write_it(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert pycache.bytecode_missing("slowpkg")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert not pycache.bytecode_missing("slowpkg")  # Python writes it into __pycache__
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    cached = Path(importlib.util.cache_from_source(str(package / "__init__.py")))
    cached.parent.mkdir()
    cached.write_bytes(b"")
    assert not pycache.bytecode_missing("slowpkg")  # installed with its bytecode
    assert not pycache.bytecode_missing("no_such_package_here")


def test_missing_where_the_package_is_read_only(package, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(pycache.os, "access", lambda path, mode: False)  # as a read-only install
    assert pycache.bytecode_missing("slowpkg")


def test_keep_points_python_and_its_children_at_the_cache(package, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    assert pycache.keep_bytecode(env, "slowpkg") == tmp_path / "cache" / "pycache"
    assert sys.pycache_prefix == str(tmp_path / "cache" / "pycache")
    assert not sys.dont_write_bytecode
    assert env == {"PYTHONPYCACHEPREFIX": str(tmp_path / "cache" / "pycache")}


@pytest.mark.parametrize(
    "env", [{"FASTTRAIN_PYCACHE": "0"}, {"PYTHONPYCACHEPREFIX": "/somewhere/of/theirs"}]
)
def test_keep_leaves_python_alone_when_told(package, tmp_path, monkeypatch, env):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path / "cache"))
    before = dict(env)
    assert pycache.keep_bytecode(env, "slowpkg") is None
    assert env == before and sys.pycache_prefix is None and sys.dont_write_bytecode


def test_the_second_process_reads_what_the_first_wrote(package, tmp_path):
    """Two processes under PYTHONDONTWRITEBYTECODE: the first writes the package's bytecode
    into the cache (not beside the source), the second imports from it."""
    code = (
        "import os, sys; from fasttrain.pycache import keep_bytecode; "
        "print(keep_bytecode(os.environ, 'slowpkg', ahead=['slowpkg'], stdlib=False)); "
        "import slowpkg; print(os.path.isfile(slowpkg.__cached__), slowpkg.__cached__)"
    )
    env = {
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",
        "FASTTRAIN_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(package.parent), str(REPO)]),
    }
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("FASTTRAIN_PYCACHE", None)

    def run() -> list[str]:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True)  # fmt: skip
        return done.stdout.split()

    first = run()
    written = Path(first[2]).stat().st_mtime_ns
    second = run()
    prefix = str(tmp_path / "cache" / "pycache")
    assert first[0] == prefix and first[1] == "True" and first[2].startswith(prefix)
    assert second == first  # the same bytecode, found where the first run left it,
    assert Path(first[2]).stat().st_mtime_ns == written  # and read, not written again
    assert not (package / "__pycache__").exists()


@pytest.fixture
def tree(package):
    """``slowpkg`` with a subpackage and tests."""
    (package / "sub").mkdir()
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "deep.py").write_text("X = 2\n")
    (package / "tests").mkdir()
    (package / "tests" / "test_it.py").write_text("def test(): pass\n")
    return package


def cached(prefix: Path, source: Path) -> Path:
    """Where Python looks for ``source``'s bytecode under ``prefix``."""
    before, sys.pycache_prefix = sys.pycache_prefix, str(prefix)
    try:
        return Path(importlib.util.cache_from_source(str(source)))
    finally:
        sys.pycache_prefix = before


@pytest.mark.parametrize("workers", [1, 2])
def test_compile_ahead_writes_the_packages_bytecode_once_per_install(tree, tmp_path, workers):
    """Run in a process of its own (``fork`` in pytest's threaded process is unsafe)."""
    prefix = tmp_path / "pycache"
    prefix.mkdir()
    code = (
        "import sys; from pathlib import Path; from fasttrain.pycache import compile_ahead; "
        f"sys.pycache_prefix = {str(prefix)!r}; "
        f"print(compile_ahead(Path({str(prefix)!r}), ['slowpkg'], {workers}, stdlib=False))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.parent), str(REPO)])}
    env.pop("PYTHONPYCACHEPREFIX", None)

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True)  # fmt: skip
        return done.stdout.strip()

    assert run() == "3"  # __init__, sub/__init__, sub/deep; not the tests
    deep = cached(prefix, tree / "sub" / "deep.py")
    assert deep.is_file() and not cached(prefix, tree / "tests" / "test_it.py").exists()
    written, before = deep.stat().st_mtime_ns, deep.read_bytes()
    assert run() == "None"  # the marker: this install is done
    assert deep.stat().st_mtime_ns == written
    later = written + 5 * 10**9
    (tree / "sub" / "deep.py").write_text("X = 3\n")  # an upgrade: new files, new times
    for path in (tree / "__init__.py", tree / "sub" / "deep.py"):
        os.utime(path, ns=(later, later))
    assert run() == "3"
    assert deep.read_bytes() != before  # the stale bytecode written again


def test_compiled_ahead_bytecode_is_what_import_reads(tree, tmp_path, monkeypatch):
    """The bytecode compiled ahead is valid for the import: the import reads it and writes
    nothing."""
    prefix = tmp_path / "pycache"
    prefix.mkdir()
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix))
    assert pycache.compile_ahead(prefix, ["slowpkg"], workers=1, stdlib=False) == 3
    deep = cached(prefix, tree / "sub" / "deep.py")
    written = deep.stat().st_mtime_ns
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    import slowpkg.sub.deep

    assert slowpkg.sub.deep.X == 2 and slowpkg.sub.deep.__cached__ == str(deep)
    assert deep.stat().st_mtime_ns == written
    for name in ("slowpkg", "slowpkg.sub", "slowpkg.sub.deep"):
        sys.modules.pop(name)


def test_roots_find_packages_modules_and_the_standard_library(tree):
    found, key = pycache.roots(["slowpkg", "typing_extensions", "no_such_package_here"])
    places = [root for root, _, _ in found]
    assert places[0] == sysconfig_stdlib() and str(tree) in places
    assert any(p.endswith("typing_extensions.py") for p in places)
    assert key[0] == [sys.version] and len(key) == len(found) + 1
    files = pycache.sources(found[1:])
    assert str(tree / "sub" / "deep.py") in files
    assert not any("tests" in Path(f).parts for f in files if f.startswith(str(tree)))


def sysconfig_stdlib() -> str:
    import sysconfig

    return sysconfig.get_paths()["stdlib"]
