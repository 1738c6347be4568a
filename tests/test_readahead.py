"""The CUDA libraries are asked into the page cache on a thread at start: which files, in what
order, and the switch that turns it off."""

import sys

import pytest

from fasttrain import readahead


@pytest.fixture
def libs(tmp_path, monkeypatch):
    """A package ``fakelibs`` laid out as the CUDA wheels are."""
    root = tmp_path / "src" / "fakelibs"
    for folder, names in {
        "cudnn/lib": ["libcudnn_ops.so.9", "libcudnn.so.9"],
        "cu13/lib": ["libcufft.so.12", "libnvrtc.so.13", "libcublasLt.so.13", "libnvJitLink.so.13"],
        "lib": ["libtorch_cpu.so", "libtorch_cuda.so", "README.txt"],
    }.items():
        (root / folder).mkdir(parents=True)
        for i, name in enumerate(names):
            (root / folder / name).write_bytes(b"x" * (100 + i))
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    sys.modules.pop("fakelibs", None)
    return root


FOLDERS = (("fakelibs", "cudnn/lib"), ("fakelibs", "cu13/lib"), ("fakelibs", "lib"))


def test_the_first_steps_libraries_in_the_order_it_needs_them(libs):
    names = [p.name for p in readahead.library_files((*FOLDERS, ("no_such_pkg", "lib")))]
    assert names == [
        "libcudnn.so.9",
        "libcudnn_ops.so.9",
        "libcublasLt.so.13",  # named first within its folder
        "libnvrtc.so.13",
        "libnvJitLink.so.13",
        "libtorch_cuda.so",
        "libtorch_cpu.so",
    ]  # not the FFTs, nor what is no library


def test_read_ahead_asks_for_every_byte_and_passes_over_what_is_gone(libs):
    files = readahead.library_files(FOLDERS)
    expected = sum(p.stat().st_size for p in files)
    assert readahead.read_ahead([*files, libs / "gone.so"]) == expected


def test_start_runs_on_a_thread_unless_turned_off(libs, monkeypatch):
    asked = []
    monkeypatch.setattr(readahead, "read_ahead", asked.append)
    monkeypatch.setattr(readahead, "library_files", lambda: ["a.so"])
    assert readahead.start_read_ahead({"FASTTRAIN_READAHEAD": "0"}) is None
    thread = readahead.start_read_ahead({})
    thread.join(10)
    assert asked == [["a.so"]] and thread.daemon
