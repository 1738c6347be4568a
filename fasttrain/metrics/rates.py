"""Rate arithmetic: the steady-state img/s of a run's log intervals, and the progress line's
account of what limits the run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def steady_rate(intervals: Sequence[tuple[int, float, float]]) -> float | None:
    """Steady-state img/s: images over time, summed over the intervals (epoch, images, seconds)
    after the first epoch.

    The first epoch is left out: it holds warm-up and compile, and a loader that prefetched
    during the compile makes it look faster than the loader is. A run shorter than two epochs
    leaves out only its first interval. Weighting by images, not a median of intervals, keeps a
    short interval at an epoch's end from counting as much as a full one.
    """
    if not intervals:
        return None
    first_epoch = intervals[0][0]
    kept = [iv for iv in intervals if iv[0] > first_epoch] or intervals[1:]
    seconds = sum(iv[2] for iv in kept)
    return sum(iv[1] for iv in kept) / seconds if seconds > 0 else None


def rates_by(
    intervals: Sequence[tuple[int, float, float]], key: Callable[[int], Any]
) -> dict[Any, float | None]:
    """``steady_rate`` of each group of intervals that ``key(epoch)`` makes (e.g. the train size
    of ``--progressive-resizing``), each group read as a run of its own."""
    groups: dict[Any, list[tuple[int, float, float]]] = {}
    for iv in intervals:
        groups.setdefault(key(iv[0]), []).append(iv)
    return {k: steady_rate(v) for k, v in groups.items()}


INPUT_BOUND = 0.05  # the GPU idle (and the host getting data) this share of the time


def progress_text(rate: float, record: dict[str, Any]) -> str:
    """What limits the run, for the progress line: img/s, how busy the GPU was, and the host's
    time getting data only when the run actually waits for it, split into waiting for the
    loader and copying to the device. With DALI the host waits in the loader most of the time
    while the GPU is busy (decode shares the GPU): that wait is not a bottleneck, so it is shown
    only when the GPU was idle too (on the CPU, where the host does the work, when the host
    waited)."""
    text = f"{rate:,.0f} img/s"
    idle = record["gpu_idle_frac"]
    loader, copy = record["loader_wait_frac"], record["copy_in_frac"]
    if idle is not None:
        text += f", GPU busy {100 * (1 - idle):.1f}%"
        if record["gpu_step_ms"] is not None:
            text += f" ({record['gpu_step_ms']:.1f} ms/step)"
    if loader + copy >= INPUT_BOUND and (idle is None or idle >= INPUT_BOUND):
        text += (
            f", host waiting for the loader {100 * loader:.0f}% and copying to the device "
            f"{100 * copy:.0f}% of the time"
        )
    return text
