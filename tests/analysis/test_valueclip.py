"""The clamp a clip by value leaves is recognised from the step's columns as piece by piece (the
object computation below is the oracle), for the table of a stats-only step and the pieces of a
full one."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from builders import FIXED

from gradaudit.analysis.valueclip import CLAMP_RTOL, ValueClipping, value_clipping
from gradaudit.capture.build import flat, write_rank
from gradaudit.dumpfile import load_step
from gradaudit.dumpfile.reader import TensorReader
from gradaudit.measure.measure import measure_step
from gradaudit.model import ClipRecord


def _oracle(m) -> ValueClipping | None:
    """Piece by piece, from the step table's rows."""
    table = m.table
    pre_, post_ = table.grad, table.clipped
    if post_ is None:
        return None
    Sums = collections.namedtuple("Sums", "max_abs sum_sq")
    pairs = [
        (int(table.rank[i]), Sums(pre_.max_abs[i], pre_.sum_sq[i]), Sums(post_.max_abs[i], post_.sum_sq[i]))
        for i in range(table.size)
        if pre_.has[i] and post_.has[i]
    ]
    if not pairs:
        return None
    value = max(post.max_abs for _, _, post in pairs)
    if not math.isfinite(value) or value <= 0:
        return None
    cut = []
    for rank, pre, post in pairs:
        if not math.isclose(post.max_abs, min(pre.max_abs, value), rel_tol=CLAMP_RTOL):
            return None
        shrink = value / pre.max_abs if pre.max_abs else math.inf
        if (
            pre.max_abs > value * (1 + 1e-4)
            and pre.sum_sq > 0
            and math.sqrt(post.sum_sq / pre.sum_sq) > shrink * (1 + 1e-4)
        ):
            cut.append(rank)
    if not cut:
        return None
    return ValueClipping(clip_value=value, ranks=tuple(sorted(set(cut))), recognised="the clamp it left")


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("stats_only", [True, False])
def test_the_clamp_is_recognised_from_the_columns_as_piece_by_piece(tmp_path, seed, stats_only):
    gen = torch.Generator().manual_seed(seed)
    how = ["clamp", "scale", "clamp one rank", "nothing"][seed % 4]
    for rank in range(3):
        grad = torch.randn(12, generator=gen) * (rank + 1)
        if how == "clamp one rank" and rank:
            grad = grad * 0.01  # below the value: the clamp leaves it as it was
        if how == "scale":
            clipped = grad * 0.5
        elif how == "nothing":
            clipped = torch.zeros(12)
        else:
            clipped = grad.clamp(-0.8, 0.8)
        write_rank(
            tmp_path,
            rank=rank,
            world_size=3,
            step=1,
            params={"w": (36,)},
            pieces=[flat("w", 12 * rank, grad=grad, grad_clipped=clipped, stats_only=stats_only)],
            clip=ClipRecord(max_norm=1.0),
            **FIXED,
        )
    step = load_step(tmp_path)
    with TensorReader(step) as reader:
        m = measure_step(step, reader, workers=1)
    found = value_clipping(step, m.table)
    assert found == _oracle(m)
    if how in ("clamp", "clamp one rank"):
        assert found is not None and found.clip_value == pytest.approx(0.8)
        assert found.ranks == ((0, 1, 2) if how == "clamp" else (0,))
    else:
        assert found is None
