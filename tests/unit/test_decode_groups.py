"""Cutting decode rows into attention groups: exact minimum of padded blocks + a cost per group."""

from __future__ import annotations

import itertools
import random

import pytest

from steadfast.worker.core.runner import split_by_width

pytestmark = pytest.mark.unit


def cost(widths: list[int], runs: list[int], group_cost: int) -> int:
    total, first = 0, 0
    for n in runs:
        total += n * widths[first] + group_cost  # padded to the run's first (widest) row
        first += n
    return total


def brute_force(widths: list[int], max_groups: int, group_cost: int) -> int:
    n = len(widths)
    best = None
    for groups in range(1, min(max_groups, n) + 1):
        for cuts in itertools.combinations(range(1, n), groups - 1):
            bounds = (0, *cuts, n)
            c = cost(widths, [b - a for a, b in itertools.pairwise(bounds)], group_cost)
            best = c if best is None else min(best, c)
    return best


def test_uniform_widths_make_one_group():
    assert split_by_width([5] * 64, 4) == [64]
    assert split_by_width([], 4) == []


def test_long_and_short_contexts_are_split_when_padding_costs_more_than_a_group():
    widths = [128] * 4 + [2] * 60
    assert split_by_width(widths, 4, group_cost=64) == [4, 60]
    assert split_by_width(widths, 1, group_cost=64) == [64]
    # A group cheaper than nothing saved is not made.
    assert split_by_width([3] * 4 + [2] * 4, 4, group_cost=64) == [8]


def test_the_split_is_optimal_and_keeps_every_row():
    rng = random.Random(7)
    for _ in range(200):
        widths = sorted((rng.randint(1, 40) for _ in range(rng.randint(1, 9))), reverse=True)
        max_groups, group_cost = rng.randint(1, 4), rng.choice([0, 3, 20, 64])
        runs = split_by_width(widths, max_groups, group_cost)
        assert sum(runs) == len(widths) and all(runs) and len(runs) <= max_groups
        assert cost(widths, runs, group_cost) == brute_force(widths, max_groups, group_cost)


def test_many_distinct_widths_are_cut_cheaply_and_keep_every_row():
    rng = random.Random(3)
    widths = sorted((rng.randint(1, 512) for _ in range(128)), reverse=True)
    runs = split_by_width(widths, 4)
    assert sum(runs) == 128 and len(runs) <= 4 and all(runs)
    assert cost(widths, runs, 64) < cost(widths, [128], 64)  # better than one padded group
