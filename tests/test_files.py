"""files.write_whole: a file is replaced whole, or left as it was."""

import pytest

from fasttrain.files import write_whole


def test_a_file_is_replaced_whole_and_no_temporary_file_stays(tmp_path):
    path = tmp_path / "new" / "kept.json"
    write_whole(path, b"first")
    write_whole(path, b"second")
    assert path.read_bytes() == b"second" and [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "kept.json"
    write_whole(path, b"old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("fasttrain.files.os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_whole(path, b"new")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == [path.name]
