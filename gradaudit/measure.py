"""Reading the dumped tensors once, by parameter, into the numbers the checks need (the shell side).

The unit of work is one logical parameter: all its pieces on all present ranks. `measure_param`
reads them by chunks (never more than a few pieces' chunks in memory) and returns a frozen
`ParamMeasurement`; `measure_step` loops over parameters, optionally a subset, and measurements of
disjoint subsets `merge` into the same result as one pass (so parameters can be split among processes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

from .model import Box, FlatRange, Piece, Region, StepDump, TensorStats, numel_of
from .tensorstats import CHUNK_ELEMENTS, StatsAccumulator

if TYPE_CHECKING:
    import torch

    from .dumpfile import TensorReader

COMPARED_KINDS = ("grad", "grad_clipped", "param_after")
"""Tensor kinds compared against an unsharded reference."""

Progress = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class PieceMeasurement:
    """One piece of a parameter on one rank: its stats per tensor kind, and two-tensor products."""

    rank: int
    index: int
    param: str
    regions: tuple[Region, ...]
    dtype: str
    numel: int
    replica_group: str | None = None
    stats: Mapping[str, TensorStats] = field(default_factory=dict)
    dot_pre_post: float | None = None
    """sum(grad * grad_clipped) over elements finite in both, when both tensors were dumped with values."""
    dot_pre_pre: float | None = None
    """sum(grad * grad) over the same elements as `dot_pre_post`."""
    update_sum_sq: float | None = None
    """sum((param_after - param_before)^2) over finite elements, when both were dumped with values."""

    @property
    def layout_key(self) -> tuple:
        return (self.param, self.regions)


@dataclass(frozen=True, kw_only=True)
class ReplicaCopy:
    """One copy of a replica set compared with the set's base (lowest-rank) copy."""

    rank: int
    index: int
    max_abs_diff: float | None = None
    """Largest |copy - base| over elements finite in both (None in stats mode)."""
    num_nonfinite_mismatch: int | None = None
    """Elements where one is finite and the other not, or both infinite with different signs."""
    fingerprint_delta: float | None = None
    """Largest difference of the fingerprint components (stats mode)."""


@dataclass(frozen=True, kw_only=True)
class ReplicaSet:
    """Pieces with one layout (same parameter, same regions) held on several ranks."""

    param: str
    regions: tuple[Region, ...]
    dtype: str
    base_rank: int
    base_index: int
    base_max_abs: float
    base_sum_sq: float
    numel: int
    copies: tuple[ReplicaCopy, ...]
    by_values: bool
    """True when the copies were compared value by value, False when only by fingerprints."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({self.base_rank, *(c.rank for c in self.copies)}))


@dataclass(frozen=True, kw_only=True)
class ReferenceError:
    """One parameter and tensor kind compared with the reference, element by element."""

    param: str
    kind: str
    dtype: str
    numel_compared: int
    max_abs_error: float
    max_abs_reference: float
    num_nonfinite_mismatch: int = 0


@dataclass(frozen=True, kw_only=True)
class ParamMeasurement:
    param: str
    norm_type: float
    pieces: tuple[PieceMeasurement, ...]
    replica_sets: tuple[ReplicaSet, ...] = ()
    reference_pieces: tuple[PieceMeasurement, ...] = ()
    """The reference dump's pieces of this parameter (their stats), when a reference was given."""
    reference_errors: tuple[ReferenceError, ...] = ()
    notes: tuple[str, ...] = ()
    """Why something about this parameter could not be measured (e.g. absent from the reference)."""


@dataclass(frozen=True, kw_only=True)
class StepMeasurements:
    """Everything read from the tensors of one step; a pure value the checks work on."""

    norm_type: float
    params: Mapping[str, ParamMeasurement]
    reference_given: bool = False
    reference_step: int | None = None
    reference_only_params: tuple[str, ...] = ()
    """Parameters the reference holds and the checked dump does not."""

    def merge(self, other: "StepMeasurements") -> "StepMeasurements":
        """Combine measurements of disjoint parameter subsets of the same step."""
        if self.norm_type != other.norm_type and not (math.isnan(self.norm_type) and math.isnan(other.norm_type)):
            raise ValueError(f"cannot merge measurements of norm types {self.norm_type} and {other.norm_type}")
        if self.reference_given != other.reference_given:
            raise ValueError("cannot merge measurements with and without a reference")
        overlap = set(self.params) & set(other.params)
        if overlap:
            raise ValueError(f"cannot merge measurements that both hold {sorted(overlap)[:3]}; split parameters disjointly")
        return StepMeasurements(
            norm_type=self.norm_type,
            params=dict(sorted({**self.params, **other.params}.items())),
            reference_given=self.reference_given,
            reference_step=self.reference_step,
            reference_only_params=tuple(sorted(set(self.reference_only_params) | set(other.reference_only_params))),
        )

    @property
    def pieces(self) -> Iterator[PieceMeasurement]:
        for pm in self.params.values():
            yield from pm.pieces


# ---------------------------------------------------------------- reading helpers


def _read_flat(reader: "TensorReader", path: str, key: str, start: int, stop: int) -> "torch.Tensor":
    """Elements [start, stop) of the row-major flattened tensor, reading only those."""
    return reader.read_range(path, key, start, stop)


def _flat_windows(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, chunk):
        yield start, min(numel, start + chunk)


def _piece_flat(reader, path: str, piece: Piece, kind: str, start: int, stop: int) -> "torch.Tensor":
    import torch

    return _read_flat(reader, path, piece.tensors[kind], start, stop).to(torch.float64)


def _read_piece(reader, path: str, piece: Piece, norm_type: float, chunk: int):
    """One pass over every tensor the piece holds (aligned chunks: they share a shape), giving
    {kind: TensorStats}, and the finite-only sums dot(grad, grad_clipped), dot(grad, grad),
    |param_after - param_before|^2 when both tensors of a pair are there."""
    import torch

    kinds = sorted(piece.tensors)
    accumulators = {kind: StatsAccumulator(norm_type) for kind in kinds}
    pre_post = "grad" in piece.tensors and "grad_clipped" in piece.tensors
    update = "param_before" in piece.tensors and "param_after" in piece.tensors
    sums: dict[str, list[float]] = {"pre_post": [], "pre_pre": [], "update": []}
    streams = [reader.chunks(path, piece.tensors[kind], max_elements=chunk) for kind in kinds]
    for chunks in zip(*streams):
        values = dict(zip(kinds, chunks))
        for kind, tensor in values.items():
            accumulators[kind].add(tensor)
        if pre_post:
            a, b = _finite_pair(values["grad"], values["grad_clipped"])
            sums["pre_post"].append(float(torch.dot(a, b)))
            sums["pre_pre"].append(float(torch.dot(a, a)))
        if update:
            a, b = _finite_pair(values["param_before"], values["param_after"])
            d = b - a
            sums["update"].append(float(torch.dot(d, d)))
    stats = {kind: acc.result() for kind, acc in accumulators.items()}
    total = lambda key, wanted: math.fsum(sums[key]) if wanted else None  # noqa: E731
    return stats, total("pre_post", pre_post), total("pre_pre", pre_post), total("update", update)


def _finite_pair(a: "torch.Tensor", b: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Both as float64 with every element that is nonfinite in either set to 0 in both."""
    import torch

    a, b = a.to(torch.float64), b.to(torch.float64)
    both = torch.isfinite(a) & torch.isfinite(b)
    if not bool(both.all()):
        zero = torch.zeros((), dtype=torch.float64)
        a, b = torch.where(both, a, zero), torch.where(both, b, zero)
    return a, b


def _nonfinite_mismatch(a: "torch.Tensor", b: "torch.Tensor") -> int:
    import torch

    fa, fb = torch.isfinite(a), torch.isfinite(b)
    pattern = fa != fb
    both_inf = torch.isinf(a) & torch.isinf(b) & (a != b)
    nan_vs_inf = (torch.isnan(a) & torch.isinf(b)) | (torch.isinf(a) & torch.isnan(b))
    return int((pattern | both_inf | nan_vs_inf).sum())


def _finite_max_abs_diff(a: "torch.Tensor", b: "torch.Tensor") -> float:
    import torch

    both = torch.isfinite(a) & torch.isfinite(b)
    if not bool(both.any()):
        return 0.0
    return float((a[both] - b[both]).abs().max())


# ---------------------------------------------------------------- one parameter


def _measure_piece(reader, rank: int, path: str, piece: Piece, norm_type: float, chunk: int) -> PieceMeasurement:
    stats, dot_pre_post, dot_pre_pre, update_sum_sq = _read_piece(reader, path, piece, norm_type, chunk)
    stats = dict(sorted({**stats, **{k: v for k, v in piece.stats.items() if k not in stats}}.items()))
    return PieceMeasurement(
        rank=rank,
        index=piece.index,
        param=piece.param,
        regions=piece.regions,
        dtype=piece.dtype,
        numel=piece.numel,
        replica_group=piece.replica_group,
        stats=stats,
        dot_pre_post=dot_pre_post,
        dot_pre_pre=dot_pre_pre,
        update_sum_sq=update_sum_sq,
    )


def _compare_replicas(reader, copies: list[tuple[int, str, Piece]], measured: Mapping[tuple[int, int], PieceMeasurement], chunk: int) -> ReplicaSet:
    """Compare every copy of one layout with the lowest-rank copy: values when all have them, else fingerprints."""
    copies = sorted(copies, key=lambda c: (c[0], c[2].index))
    base_rank, base_path, base = copies[0]
    base_stats = measured[(base_rank, base.index)].stats.get("grad")
    by_values = all("grad" in p.tensors for _, _, p in copies)
    results = []
    if by_values:
        others = copies[1:]
        per_copy = max(1 << 16, chunk // max(1, len(copies)))
        diffs = [0.0] * len(others)
        mismatches = [0] * len(others)
        for start, stop in _flat_windows(base.numel, per_copy):
            ref = _piece_flat(reader, base_path, base, "grad", start, stop)
            for i, (_, path, piece) in enumerate(others):
                values = _piece_flat(reader, path, piece, "grad", start, stop)
                diffs[i] = max(diffs[i], _finite_max_abs_diff(values, ref))
                mismatches[i] += _nonfinite_mismatch(values, ref)
        results = [
            ReplicaCopy(rank=r, index=p.index, max_abs_diff=d, num_nonfinite_mismatch=n)
            for (r, _, p), d, n in zip(others, diffs, mismatches)
        ]
    else:
        for rank, _, piece in copies[1:]:
            stats = measured[(rank, piece.index)].stats.get("grad")
            delta = None
            if stats is not None and base_stats is not None and len(stats.fingerprint) == len(base_stats.fingerprint):
                delta = max(
                    [abs(a - b) for a, b in zip(stats.fingerprint, base_stats.fingerprint)]
                    + [abs(math.sqrt(stats.sum_sq) - math.sqrt(base_stats.sum_sq)), abs(stats.max_abs - base_stats.max_abs)]
                )
                if stats.num_nonfinite != base_stats.num_nonfinite:
                    delta = math.inf
            results.append(ReplicaCopy(rank=rank, index=piece.index, fingerprint_delta=delta))
    return ReplicaSet(
        param=base.param,
        regions=base.regions,
        dtype=base.dtype,
        base_rank=base_rank,
        base_index=base.index,
        base_max_abs=0.0 if base_stats is None else base_stats.max_abs,
        base_sum_sq=0.0 if base_stats is None else base_stats.sum_sq,
        numel=base.numel,
        copies=tuple(results),
        by_values=by_values,
    )


class _ReferenceSource:
    """Values of one parameter in the reference dump, by region, reading only what is asked for.

    A reference piece holding the whole parameter is sliced in the file; any other cover of the
    parameter (a sharded reference) is assembled densely in memory first (references are small models).
    """

    def __init__(self, reader, global_shape: tuple[int, ...], pieces: list[tuple[str, Piece]], kind: str) -> None:
        self.reader = reader
        self.global_shape = global_shape
        self.kind = kind
        self.whole: tuple[str, Piece] | None = None
        self.dense = None
        numel = numel_of(global_shape)
        for path, piece in pieces:
            if kind in piece.tensors and _is_whole(piece.regions, global_shape):
                self.whole = (path, piece)
                return
        self.dense = _assemble_dense(reader, global_shape, [(p, pc) for p, pc in pieces if kind in pc.tensors], kind, numel)

    def flat(self, start: int, stop: int) -> "torch.Tensor":
        import torch

        if self.whole is not None:
            path, piece = self.whole
            return _read_flat(self.reader, path, piece.tensors[self.kind], start, stop).to(torch.float64)
        return self.dense.reshape(-1)[start:stop]

    def box(self, offsets: tuple[int, ...], shape: tuple[int, ...]) -> "torch.Tensor":
        """The box's elements, row-major: the whole rows that hold it are read, then cut."""
        index = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
        if self.whole is not None:
            if len(shape) == 0:
                return self.flat(0, 1)
            inner = numel_of(self.global_shape[1:])
            rows = self.flat(offsets[0] * inner, (offsets[0] + shape[0]) * inner)
            return rows.reshape((shape[0],) + tuple(self.global_shape[1:]))[(slice(None),) + index[1:]].reshape(-1)
        return self.dense[index].reshape(-1)


def _is_whole(regions: tuple[Region, ...], global_shape: tuple[int, ...]) -> bool:
    if len(regions) != 1:
        return False
    region = regions[0]
    if isinstance(region, FlatRange):
        return region.start == 0 and region.stop == numel_of(global_shape)
    return all(o == 0 for o in region.offsets) and tuple(region.shape) == tuple(global_shape)


def _assemble_dense(reader, global_shape, pieces, kind: str, numel: int) -> "torch.Tensor":
    import torch

    dense = torch.full((numel,), math.nan, dtype=torch.float64)
    for path, piece in pieces:
        values = reader.read(path, piece.tensors[kind]).to(torch.float64).reshape(-1)
        offset = 0
        for region in piece.regions:
            index = _flat_index_of(region, global_shape)
            dense[index] = values[offset : offset + region.numel]
            offset += region.numel
    return dense.reshape(global_shape)


def _flat_index_of(region: Region, global_shape: tuple[int, ...]) -> "torch.Tensor":
    import torch

    if isinstance(region, FlatRange):
        return torch.arange(region.start, region.stop)
    return torch.arange(numel_of(global_shape)).reshape(global_shape)[
        tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape))
    ].reshape(-1)


def _region_windows(region: Region, chunk: int) -> Iterator[tuple[Region, int]]:
    """Sub-regions of at most about `chunk` elements, each with its element offset inside the region."""
    if isinstance(region, FlatRange):
        for start, stop in _flat_windows(region.numel, chunk):
            yield FlatRange(start=region.start + start, stop=region.start + stop), start
        return
    if len(region.shape) == 0 or region.numel == 0:
        yield region, 0
        return
    inner = numel_of(region.shape[1:])
    rows_per_chunk = max(1, chunk // max(inner, 1))
    for row in range(0, region.shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, region.shape[0] - row)
        sub = Box(offsets=(region.offsets[0] + row,) + region.offsets[1:], shape=(rows,) + region.shape[1:])
        yield sub, row * inner


def _compare_with_reference(
    reader, param: str, rank_path: str, piece: Piece, source: _ReferenceSource, kind: str, chunk: int
) -> ReferenceError:
    import torch

    max_err, max_ref, mismatches, compared = 0.0, 0.0, 0, 0
    region_offset = 0
    for region in piece.regions:
        for sub, offset in _region_windows(region, chunk):
            start = region_offset + offset
            ours = _piece_flat(reader, rank_path, piece, kind, start, start + sub.numel)
            ref = source.flat(sub.start, sub.stop) if isinstance(sub, FlatRange) else source.box(sub.offsets, sub.shape)
            max_err = max(max_err, _finite_max_abs_diff(ours, ref))
            finite_ref = ref[torch.isfinite(ref)]
            if finite_ref.numel():
                max_ref = max(max_ref, float(finite_ref.abs().max()))
            mismatches += _nonfinite_mismatch(ours, ref)
            compared += sub.numel
        region_offset += region.numel
    return ReferenceError(
        param=param,
        kind=kind,
        dtype=piece.dtype,
        numel_compared=compared,
        max_abs_error=max_err,
        max_abs_reference=max_ref,
        num_nonfinite_mismatch=mismatches,
    )


def _merge_errors(errors: list[ReferenceError]) -> ReferenceError:
    first = errors[0]
    return ReferenceError(
        param=first.param,
        kind=first.kind,
        dtype=max((e.dtype for e in errors), key=_dtype_looseness),
        numel_compared=sum(e.numel_compared for e in errors),
        max_abs_error=max(e.max_abs_error for e in errors),
        max_abs_reference=max(e.max_abs_reference for e in errors),
        num_nonfinite_mismatch=sum(e.num_nonfinite_mismatch for e in errors),
    )


def _dtype_looseness(dtype: str) -> float:
    from .norms import norm_rtol

    return norm_rtol([dtype])


def measure_param(
    step: StepDump,
    name: str,
    reader: "TensorReader",
    *,
    norm_type: float,
    reference: StepDump | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    held: list[tuple[int, str, Piece]] | None = None,
    reference_held: list[tuple[int, str, Piece]] | None = None,
) -> ParamMeasurement:
    """Measure one logical parameter: every piece on every present rank, its replicas, its reference.

    `held` / `reference_held` are this parameter's (rank, path, piece) entries when the caller
    indexed them already (see `pieces_by_param`)."""
    if held is None:
        held = pieces_by_param(step).get(name, [])
    measured = {
        (rank, piece.index): _measure_piece(reader, rank, path, piece, norm_type, chunk_elements) for rank, path, piece in held
    }
    by_layout: dict[tuple, list] = {}
    for rank, path, piece in held:
        by_layout.setdefault(piece.layout_key, []).append((rank, path, piece))
    replica_sets = tuple(
        _compare_replicas(reader, copies, measured, chunk_elements)
        for _, copies in sorted(by_layout.items(), key=lambda kv: min((r, p.index) for r, _, p in kv[1]))
        if len(copies) > 1
    )
    reference_pieces, reference_errors, notes = (), (), ()
    if reference is not None:
        if reference_held is None:
            reference_held = pieces_by_param(reference).get(name, [])
        reference_pieces, reference_errors, notes = _measure_reference(
            step, name, reader, reference, reference_held, by_layout, norm_type=norm_type, chunk=chunk_elements
        )
    return ParamMeasurement(
        param=name,
        norm_type=norm_type,
        pieces=tuple(measured[k] for k in sorted(measured)),
        replica_sets=replica_sets,
        reference_pieces=reference_pieces,
        reference_errors=reference_errors,
        notes=notes,
    )


def pieces_by_param(step: StepDump) -> dict[str, list[tuple[int, str, Piece]]]:
    """Parameter -> (rank, file path, piece) of every piece that holds part of it, by rank."""
    found: dict[str, list[tuple[int, str, Piece]]] = {}
    for rank in step.ranks_present:
        dump = step.ranks[rank]
        for piece in dump.pieces:
            found.setdefault(piece.param, []).append((rank, dump.path, piece))
    return found


def _measure_reference(step, name, reader, reference: StepDump, ref_held, by_layout, *, norm_type: float, chunk: int):
    info = step.params.get(name)
    ref_info = reference.params.get(name)
    if ref_info is None:
        return (), (), (f"{name}: not in the reference dump",)
    if info is not None and tuple(ref_info.global_shape) != tuple(info.global_shape):
        return (), (), (
            f"{name}: shape {list(info.global_shape)} here but {list(ref_info.global_shape)} in the reference",
        )
    reference_pieces = tuple(
        _measure_piece(reader, rank, path, piece, norm_type, chunk) for rank, path, piece in ref_held
    )
    errors, notes = [], []
    for kind in COMPARED_KINDS:
        ref_with_values = [(path, piece) for _, path, piece in ref_held if kind in piece.tensors]
        ours = [min(copies, key=lambda c: (c[0], c[2].index)) for copies in by_layout.values()]
        ours = [(rank, path, piece) for rank, path, piece in ours if kind in piece.tensors]
        if not ours or not ref_with_values:
            continue
        if not _covers(ref_with_values, ref_info.global_shape):
            notes.append(f"{name}: the reference's {kind} pieces do not cover the parameter; not compared")
            continue
        source = _ReferenceSource(reader, tuple(ref_info.global_shape), ref_with_values, kind)
        per_piece = [
            _compare_with_reference(reader, name, path, piece, source, kind, chunk)
            for _, path, piece in sorted(ours, key=lambda c: (c[0], c[2].index))
        ]
        errors.append(_merge_errors(per_piece))
    return reference_pieces, tuple(errors), tuple(notes)


def _covers(pieces: list[tuple[str, Piece]], global_shape: tuple[int, ...]) -> bool:
    layouts = {piece.regions for _, piece in pieces}
    return sum(sum(r.numel for r in regions) for regions in layouts) >= numel_of(global_shape)


def measure_step(
    step: StepDump,
    reader: "TensorReader",
    *,
    norm_type: float | None = None,
    reference: StepDump | None = None,
    params: Iterable[str] | None = None,
    progress: Progress | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> StepMeasurements:
    """Measure the given parameters (all of the step's by default) of one step, one parameter at a time.

    `progress(done, total)` is called after each parameter when given.
    """
    if norm_type is None:
        norm_type = step.clip.norm_type if step.clip is not None else 2.0
    names = sorted(step.params) if params is None else sorted(set(params))
    unknown = [n for n in names if n not in step.params]
    if unknown:
        raise ValueError(f"parameters {unknown[:3]} are not in step {step.step}; pass names from step.params")
    held = pieces_by_param(step)
    reference_held = None if reference is None else pieces_by_param(reference)
    results = {}
    for done, name in enumerate(names, start=1):
        results[name] = measure_param(
            step,
            name,
            reader,
            norm_type=norm_type,
            reference=reference,
            chunk_elements=chunk_elements,
            held=held.get(name, []),
            reference_held=None if reference_held is None else reference_held.get(name, []),
        )
        if progress is not None:
            progress(done, len(names))
    reference_only = ()
    if reference is not None:
        reference_only = tuple(sorted(set(reference.params) - set(step.params)))
    return StepMeasurements(
        norm_type=norm_type,
        params=results,
        reference_given=reference is not None,
        reference_step=None if reference is None else reference.step,
        reference_only_params=reference_only,
    )
