"""Builders for hand-made step dumps: each test states only what matters to it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from gradaudit.audit import audit_step_dir
from gradaudit.capture.build import PieceSpec, box, flat, whole, write_rank
from gradaudit.checks.base import AuditOptions
from gradaudit.model import ClipRecord, DataRecord, Topology
from gradaudit.report.model import Report

__all__ = [
    "box",
    "check",
    "clip",
    "codes",
    "flat",
    "sharded_rows",
    "tensor_with_norm",
    "whole",
    "write_one_rank",
    "write_step",
]

FIXED = {"host": "host-a", "created_at": "2026-01-01T00:00:00+00:00", "run_id": "test-run"}


def tensor_with_norm(norm: float, shape: Sequence[int], seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """A random tensor of `shape` whose L2 norm is `norm` (up to the dtype's rounding)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return (t * (norm / t.norm())).to(dtype)


def clip(max_norm: float = 1.0, **kw) -> ClipRecord:
    return ClipRecord(max_norm=max_norm, **kw)


def write_step(
    directory: str | Path,
    *,
    world_size: int,
    params: Mapping[str, Sequence[int]],
    pieces: Mapping[int, Sequence[PieceSpec]],
    clips: Mapping[int, ClipRecord | None] | ClipRecord | None = None,
    data: Mapping[int, DataRecord] | None = None,
    topology: Topology | None = None,
    step: int = 1,
    norm_type: float | None = None,
) -> Path:
    """Write one file per rank in `pieces` (ranks left out are missing); `clips` per rank or shared."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for rank, specs in sorted(pieces.items()):
        rank_clip = clips.get(rank) if isinstance(clips, Mapping) else clips
        write_rank(
            directory,
            rank=rank,
            world_size=world_size,
            step=step,
            params=params,
            pieces=list(specs),
            clip=rank_clip,
            topology=topology,
            data=(data or {}).get(rank),
            norm_type=norm_type,
            **FIXED,
        )
    return directory


def write_one_rank(
    directory: str | Path,
    *,
    params: Mapping[str, Sequence[int]],
    pieces: Sequence[PieceSpec],
    clip: ClipRecord | None = None,
    **kw,
) -> Path:
    """Step 1 of a one-rank run, clipped with max_norm 1 unless `clip` says otherwise; the rank file's path.

    `kw` goes to capture.build.write_rank (host, created_at and run_id default to FIXED)."""
    return write_rank(
        directory,
        rank=0,
        world_size=1,
        step=1,
        params=params,
        pieces=list(pieces),
        clip=clip or ClipRecord(max_norm=1.0),
        **{**FIXED, **kw},
    )


def sharded_rows(
    directory: str | Path,
    grads: Sequence[torch.Tensor],
    *,
    clips: Mapping[int, ClipRecord] | ClipRecord | None,
    clipped: Sequence[torch.Tensor] | None = None,
    param: str = "w",
    **kw,
) -> Path:
    """Parameter `param` split by rows, rank r holding grads[r] (all of equal shape)."""
    rows = grads[0].shape[0]
    shape = (rows * len(grads),) + tuple(grads[0].shape[1:])
    pieces = {
        rank: [
            box(
                param,
                (rank * rows,) + (0,) * (g.dim() - 1),
                grad=g,
                **({} if clipped is None else {"grad_clipped": clipped[rank]}),
            )
        ]
        for rank, g in enumerate(grads)
    }
    return write_step(
        directory, world_size=len(grads), params={param: shape}, pieces=pieces, clips=clips, **kw
    )


def clean_step(directory: str | Path, data: Mapping[int, DataRecord] | None = None) -> Path:
    """Two ranks of float64 rows whose true norm 0.3 every rank reported and did not clip by: no finding."""
    grads = [tensor_with_norm(0.3, (2, 2), seed=r, dtype=torch.float64) for r in range(2)]
    true = float(torch.cat(grads).norm())
    return sharded_rows(directory, grads, clips=clip(1.0, reported_norm=true, clip_coef=1.0), data=data)


def check(directory: str | Path, **options) -> Report:
    return audit_step_dir(directory, AuditOptions(**options))


def codes(report: Report) -> set[str]:
    return {f.code for f in report.findings}


def not_checked(report: Report) -> set[str]:
    return {n.code for n in report.not_checked}


def finding(report: Report, code: str):
    found = [f for f in report.findings if f.code == code]
    assert len(found) == 1, f"expected one {code}, got {[(f.code, f.message) for f in report.findings]}"
    return found[0]


def assert_close(a: float, b: float, rel: float = 1e-9) -> None:
    assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-12), (a, b)


def assert_exact_sums(stats, values: Sequence[float], norm_type: float) -> None:
    """`stats` (a capture-side or check-side accumulator's result) hold the exact sums of the finite
    `values` within 1e-12, their largest magnitude, and the count of each nonfinite kind."""
    finite = [v for v in values if math.isfinite(v)]
    exact_sq = float(sum(Fraction(v) ** 2 for v in finite))
    assert stats.sum_sq == pytest.approx(exact_sq, rel=1e-12, abs=1e-300)
    assert stats.max_abs == max((abs(v) for v in finite), default=0.0)
    if math.isinf(norm_type):
        assert stats.sum_pow == stats.max_abs
    else:
        exact_pow = math.fsum(abs(v) ** norm_type for v in finite)
        assert stats.sum_pow == pytest.approx(exact_pow, rel=1e-12, abs=1e-300)
    assert (stats.num_nan, stats.num_posinf, stats.num_neginf) == (
        sum(math.isnan(v) for v in values),
        values.count(math.inf),
        values.count(-math.inf),
    )


def assert_same_tables(a, b) -> None:
    """Two step tables hold the same entries: every column equal (nan where nan), the layouts as
    the same classes (their numbers may differ: equal ids are replicas), the same per-call columns."""
    import dataclasses

    import numpy as np

    def same(x, y, where: str) -> None:
        if dataclasses.is_dataclass(x) or dataclasses.is_dataclass(y):
            assert type(x) is type(y), where
            for f in dataclasses.fields(x):
                same(getattr(x, f.name), getattr(y, f.name), f"{where}.{f.name}")
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.shape == y.shape, where
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), where
        elif isinstance(x, tuple) and where.endswith("calls"):
            assert len(x) == len(y), where
            for k, (p, q) in enumerate(zip(x, y, strict=True)):
                same(p, q, f"{where}[{k}]")
        else:
            assert x == y, where

    def classes(layout):
        _, first, inverse = np.unique(layout, return_index=True, return_inverse=True)
        return np.argsort(np.argsort(first))[inverse]

    same(
        dataclasses.replace(a, layout=classes(a.layout)), dataclasses.replace(b, layout=classes(b.layout)), ""
    )
    assert np.array_equal(a.cover, b.cover)


def assert_same_measurements(a, b) -> None:
    """Two StepMeasurements are the same: every field equal, the step tables as assert_same_tables."""
    import dataclasses

    assert dataclasses.replace(a, table=None, reference_table=None) == dataclasses.replace(
        b, table=None, reference_table=None
    )
    assert_same_tables(a.table, b.table)
    assert (a.reference_table is None) == (b.reference_table is None)
    if a.reference_table is not None:
        assert_same_tables(a.reference_table, b.reference_table)


def step_table_of(rows, norm_type: float):
    """A step table of (rank, index, layout, gradient TensorStats) rows of one parameter "w", in
    the given order: the row form as a test states it."""
    import numpy as np

    from gradaudit.norms import flags_of_stats, term_of
    from gradaudit.steptable import KindColumns, StepTable

    n = len(rows)
    stats = [s for *_, s in rows]
    terms = [term_of(s, norm_type) for s in stats]
    column = np.array
    zeros = np.zeros(n)
    layout = column([r[2] for r in rows], dtype=np.int64).reshape(n)
    return StepTable(
        norm_type=norm_type,
        rank=column([r[0] for r in rows], dtype=np.int64).reshape(n),
        index=column([r[1] for r in rows], dtype=np.int64).reshape(n),
        param=np.zeros(n, dtype=np.int64),
        param_names=("w",),
        layout=layout,
        dtypes=frozenset({"float64"}) if n else frozenset(),
        grad=KindColumns(
            has=np.ones(n, dtype=bool),
            sum_sq=column([s.sum_sq for s in stats], dtype=np.float64).reshape(n),
            max_abs=column([s.max_abs for s in stats], dtype=np.float64).reshape(n),
            counts=column([(s.num_nan, s.num_posinf, s.num_neginf) for s in stats], dtype=np.int64).reshape(
                n, 3
            ),
            term=column([math.nan if t is None else t for t in terms], dtype=np.float64).reshape(n),
            flags=column(
                [flags_of_stats(s, t) for s, t in zip(stats, terms, strict=True)], dtype=np.int8
            ).reshape(n),
        ),
        clipped=None,
        has_dots=np.zeros(n, dtype=bool),
        dot_pre_post=zeros,
        dot_pre_pre=zeros,
        has_update=np.zeros(n, dtype=bool),
        update_sum_sq=zeros,
        numel=column([s.numel for s in stats], dtype=np.int64).reshape(n),
        distinct_layouts=bool(np.unique(layout).size == n),
    )
