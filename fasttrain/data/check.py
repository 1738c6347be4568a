"""``python -m fasttrain check-data DIR``: find the images that fail to decode, once, before a long
run, and write the list of them that every loader then leaves out.

The DALI loader needs this: DALI stops on an undecodable file and does not say which it was. (The
torchvision loader also skips bad files as it meets them.) Each image is fully decoded with PIL in
a process pool. Where DALI is installed, the files PIL accepts then go through DALI's own decoder
(CPU mode) too, in batches, a failing batch file by file: PIL reads formats DALI does not (a TGA
named .jpg, say), and one of those would stop a DALI run just the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from PIL import Image

from fasttrain.data.folder import scan_folder
from fasttrain.errors import UserError


def decode_error(path: str) -> str | None:
    """Why ``path`` does not decode to an RGB image, or None if it does."""
    try:
        with Image.open(path) as im:
            im.convert("RGB").load()
    except Exception as e:  # PIL raises many types for bad files
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def find_bad_files(
    root: str | Path, workers: int, progress: Callable[[int, int], None] | None = None
) -> tuple[int, list[tuple[str, str]]]:
    """Decode every train and val image; returns (images checked, [(path, reason)])."""
    ds = scan_folder(root)  # the layout checks come first, with their one-line errors
    files = [path for path, _ in ds.train + ds.val]
    bad: list[tuple[str, str]] = []
    with ProcessPoolExecutor(workers) as pool:
        for i, (path, err) in enumerate(
            zip(files, pool.map(decode_error, files, chunksize=64), strict=True)
        ):
            if err is not None:
                bad.append((path, err))
            if progress is not None and (i + 1) % 1000 == 0:
                progress(i + 1, len(files))
    return len(files), bad


def find_dali_rejects(
    files: list[str],
    threads: int,
    batch: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> list[tuple[str, str]]:
    """The files DALI's CPU image decoder rejects: [(path, reason)]."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    # synchronous, no prefetch: each run decodes exactly the chunk just fed
    @pipeline_def(
        batch_size=batch,
        num_threads=max(1, threads),
        device_id=None,
        prefetch_queue_depth=1,
        exec_pipelined=False,
        exec_async=False,
    )
    def decode():
        encoded = fn.external_source(name="encoded", dtype=types.UINT8)
        return fn.decoders.image(encoded, device="cpu", output_type=types.RGB)

    pipe = None

    def fails(chunk: list[str]) -> str | None:
        nonlocal pipe
        if pipe is None:  # built once, and again only after a failure: a pipeline that raised
            pipe = decode()  # is no longer valid
            pipe.build()
        pipe.feed_input("encoded", [np.fromfile(f, dtype=np.uint8) for f in chunk])
        try:
            pipe.run()
        except RuntimeError as e:  # DALI's own words follow "encountered:"
            pipe = None
            lines = [x.strip() for x in str(e).splitlines() if x.strip()]
            after = lines[lines.index("encountered:") + 1 :] if "encountered:" in lines else lines
            return "DALI's decoder rejects it: " + (after[0] if after else "error")[:160]
        return None

    bad: list[tuple[str, str]] = []
    for i in range(0, len(files), batch):
        chunk = files[i : i + batch]
        if fails(chunk) is not None:
            bad += [(f, why) for f in chunk if (why := fails([f])) is not None]
        if progress is not None:
            progress(min(i + batch, len(files)), len(files))
    return bad


def write_exclude_list(path: Path, root: str | Path, bad: list[tuple[str, str]]) -> None:
    """One JSON document: every file's absolute path (any character a file name may hold, a
    newline included, survives) and the reason it was rejected."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "found_by": "python -m fasttrain check-data",
        "root": os.path.abspath(root),
        "files": [{"path": os.path.abspath(p), "reason": reason} for p, reason in bad],
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)


def read_exclude_list(path: str | Path) -> set[str]:
    """The absolute paths an exclusion list names: check-data's JSON document, or a text file
    with one path per line (``#`` starts a comment line), as a user may write by hand."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        try:
            files = json.loads(text)["files"]
            return {os.path.abspath(f["path"]) for f in files}
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"--exclude-list {path}: not a list check-data wrote ({type(e).__name__}); run "
                "python -m fasttrain check-data again"
            ) from None
    return {
        os.path.abspath(line.strip())
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    }
