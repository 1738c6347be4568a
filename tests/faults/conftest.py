"""What the fault tests share: the one-line error they expect, and a copy of the tiny data set
to break."""

from __future__ import annotations

import shutil


def one_line_error(err: str) -> str:
    """The one error line in ``err``: there is exactly one, and no traceback."""
    lines = [ln for ln in err.splitlines() if ln.startswith("fasttrain: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def copy_data(tiny_data, tmp_path):
    """A copy of the tiny data set, free to break."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data, symlinks=True)
    return data
