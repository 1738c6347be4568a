"""The search behind --batch-size auto (the measured trials themselves run in tests/test_gpu.py)."""

import pytest

from fasttrain.autobatch import LIMIT, MULTIPLE, search


@pytest.mark.parametrize("capacity", [8, 9, 63, 64, 100, 1000, 2999, 3000, 5000])
def test_search_finds_the_largest_fitting_multiple_of_8_within_6_percent(capacity):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= capacity

    found = search(fits)
    assert found <= capacity and found % MULTIPLE == 0
    assert capacity - found < max(MULTIPLE, capacity / 16)
    assert len(tried) <= 14  # doublings and a short bisection: about a minute of trials
    assert fits(found) and not fits(found + max(MULTIPLE, found // 16 // 8 * 8) + MULTIPLE)


def test_search_returns_0_when_nothing_fits_and_the_limit_when_everything_does():
    assert search(lambda b: False) == 0
    assert search(lambda b: True) == LIMIT
    assert search(lambda b: True, limit=1000) == 512  # doublings from 64 that stay under it
