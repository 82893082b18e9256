"""Rank sets as compact text, shared by check messages and renderers."""

from __future__ import annotations

from collections.abc import Iterable


def compact_ranks(ranks: Iterable[int]) -> str:
    """Sorted ranks with consecutive runs collapsed: (0, 1, 2, 3, 7, 9, 10) -> "0-3, 7, 9-10"; "" if none."""
    return ", ".join(f"{first}" if first == last else f"{first}-{last}" for first, last in rank_runs(ranks))


def rank_runs(ranks: Iterable[int]) -> list[list[int]]:
    """Sorted ranks as inclusive runs: (0, 1, 2, 3, 7, 9, 10) -> [[0, 3], [7, 7], [9, 10]]."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return runs
