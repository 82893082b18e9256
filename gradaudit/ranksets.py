"""Rank sets as compact text, shared by check messages and renderers."""

from __future__ import annotations

from collections.abc import Iterable


def compact_ranks(ranks: Iterable[int]) -> str:
    """Sorted ranks with consecutive runs collapsed: (0, 1, 2, 3, 7, 9, 10) -> "0-3, 7, 9-10"; "" if none."""
    ordered = sorted(set(ranks))
    runs: list[str] = []
    last = None
    for rank in ordered:
        if last is not None and rank == last + 1:
            first = runs[-1].split("-")[0]
            runs[-1] = f"{first}-{rank}"
        else:
            runs.append(str(rank))
        last = rank
    return ", ".join(runs)


def rank_runs(ranks: Iterable[int]) -> list[list[int]]:
    """Sorted ranks as inclusive runs: (0, 1, 2, 3, 7, 9, 10) -> [[0, 3], [7, 7], [9, 10]]."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return runs
