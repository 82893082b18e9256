"""Statistics of each piece's gradient just before each clip call, for steps with two or more calls."""

from __future__ import annotations

from ..model import TensorStats, numel_of
from .snapshots import Snapshots


def zero_stats(numel: int, norm_type: float) -> TensorStats:
    """What an absent gradient contributes: zeros (FSDP2 under `set_requires_gradient_sync(False)`)."""
    return TensorStats(
        numel=numel, norm_type=norm_type, sum_pow=0.0, sum_sq=0.0, max_abs=0.0, fingerprint=(0.0, 0.0)
    )


def grad_stats_of_snapshot(snapshots: Snapshots) -> dict[int, TensorStats]:
    """Per piece index: TensorStats of the "grad" snapshot as it stands (taken just before a clip call).

    Reuses the statistics stats mode already computed, else computes them from the kept copy where it
    lives; a piece without a snapshot had no gradient at that moment and counts as zeros.
    """
    from .tensorstats import stats_of_tensor

    out: dict[int, TensorStats] = {}
    for index, piece in enumerate(snapshots.pieces):
        if index in snapshots.failed:
            continue
        stats = snapshots.stats.get((index, "grad"))
        if stats is None:
            value = snapshots.values.get((index, "grad"))
            if value is None:
                stats = zero_stats(numel_of(piece.local_shape), snapshots.norm_type)
            else:
                stats = stats_of_tensor(value, snapshots.norm_type)
        out[index] = stats
    return out


def per_piece(calls: list[dict[int, TensorStats]], num_pieces: int) -> dict[int, tuple[TensorStats, ...]]:
    """Transpose per-call statistics to per-piece tuples, keeping only pieces seen at every call."""
    if len(calls) < 2:
        return {}
    rows = {index: tuple(call.get(index) for call in calls) for index in range(num_pieces)}
    return {index: row for index, row in rows.items() if None not in row}  # type: ignore[misc]
