"""A dumped step as it is loaded: each rank's file (`RankDump`: its facts and its pieces) and the
step's (`StepDump`), and a rank's pieces as columns (`ColumnarPieces`, the layout of format 1.1;
`Piece` objects are rows built from them on demand). The analysis sees a step as its facts
(`model.StepFacts`) and its pieces through the step table; these are the files' own forms."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import numpy as np

from ..model import (
    Box,
    FlatRange,
    ParamInfo,
    Piece,
    RankFacts,
    Region,
    StepFacts,
    TensorKind,
    TensorStats,
    read_only,
)


@dataclass(frozen=True, kw_only=True)
class RankDump(RankFacts):
    """One rank's file: its facts and its pieces (what the pieces show of the layout is read from
    them: `tensor_kinds`, `holds_flat_range`, `all_replicated`)."""

    path: str
    """The file it was read from ("" before it is written)."""
    pieces: ColumnarPieces
    """The pieces, as columns of `params` (`as_columns(params, pieces)` of Piece objects)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """This rank's parameter name -> logical name, for the names that differ (wrapper prefixes)."""
    header_digest: bytes = field(default=b"", compare=False, repr=False)
    """The digest of the file's header as it was loaded (b"" for a dump not read from a file), so that
    the tensor reader can refuse a file changed since without decoding it again."""
    tensor_kinds: tuple[TensorKind, ...] = field(init=False, default=())
    """Read from the pieces (`ColumnarPieces.tensor_kinds`)."""
    holds_flat_range: bool = field(init=False, default=False)
    """Read from the pieces (`ColumnarPieces.holds_flat_range`)."""
    all_replicated: bool = field(init=False, default=False)
    """Read from the pieces: their replica group column."""

    def __post_init__(self) -> None:
        super().__post_init__()
        pieces = self.pieces
        object.__setattr__(self, "tensor_kinds", pieces.tensor_kinds)
        object.__setattr__(self, "holds_flat_range", pieces.holds_flat_range)
        object.__setattr__(self, "all_replicated", bool(len(pieces) and (pieces.rows[:, 1] >= 0).all()))


@dataclass(frozen=True, kw_only=True)
class StepDump(StepFacts):
    """All ranks of one step as the loader found them: their files, pieces included."""

    ranks: Mapping[int, RankDump]
    """Rank -> its dump, for the ranks present."""


@dataclass(frozen=True, kw_only=True)
class PieceExtras:
    """What some pieces hold beyond the columns of `ColumnarPieces`, by position (all empty for the
    pieces of a format-1.1 rank, which the columns hold whole): the format-1.0 fields."""

    tensors: Mapping[TensorKind, Mapping[int, str]] = field(default_factory=dict)
    """Tensor kind -> position -> its key in the rank's safetensors file (kinds dumped with values)."""
    absent: Mapping[TensorKind, frozenset[int]] = field(default_factory=dict)
    """Kind -> the positions whose piece holds no statistics of that kind (its column rows are zeros)."""
    odd_stats: Mapping[tuple[int, TensorKind], TensorStats] = field(default_factory=dict)
    """(position, kind) -> statistics the columns would not give back equal (another norm type,
    fingerprint length or element count than the column's); the columns hold their sums too."""
    call_stats: Mapping[int, tuple[TensorStats, ...]] = field(default_factory=dict)
    """Position -> `Piece.call_stats`, for the pieces that have them."""
    regions: Mapping[int, tuple[Region, ...]] = field(default_factory=dict)
    """Position -> the regions of a piece that is not one flat range or one box of at least one dimension."""
    local_shapes: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Position -> the local shape, where its regions do not imply it."""
    dtypes: Mapping[int, str] = field(default_factory=dict)
    """Position -> the dtype of the dumped values, where it is not the parameter's."""
    local_names: Mapping[int, str] = field(default_factory=dict)
    """Position -> `Piece.local_name`, where it is set."""
    partial_groups: Mapping[int, str] = field(default_factory=dict)
    """Position -> `Piece.partial_group`, where it is set."""

    @property
    def empty(self) -> bool:
        return not any(getattr(self, f.name) for f in dataclasses.fields(self))


NO_EXTRAS = PieceExtras()


class ColumnarPieces(Sequence[Piece]):
    """A rank's pieces as columns (read-only arrays, the layout of format 1.1: see
    dumpfile/columnar.py) and, for what the columns have no place for, `extras`. A `Piece` is a
    validated row built each time one is indexed or iterated, and not kept. Equal to any sequence
    of equal pieces.

    `rows` [n, 4]: param index, replica group index (-1: none), first coordinate in `coords`, ndim
    (0: a flat range [start, stop), k: a k-D box); `stats[kind]` [n, 3+f]: sum_pow, sum_sq,
    max_abs, fingerprint; `counts[kind]` [n, 3]: num_nan, num_posinf, num_neginf."""

    __slots__ = ("_numel", "coords", "counts", "extras", "groups", "norm_type", "params", "rows", "stats")

    def __init__(
        self,
        rows: np.ndarray,
        coords: np.ndarray,
        params: Sequence[ParamInfo],
        groups: Sequence[str],
        stats: Mapping[str, np.ndarray] | Mapping[TensorKind, np.ndarray],
        counts: Mapping[str, np.ndarray] | Mapping[TensorKind, np.ndarray],
        norm_type: float,
        *,
        extras: PieceExtras = NO_EXTRAS,
    ) -> None:
        self.rows, self.coords = read_only(rows), read_only(coords)
        self.params, self.groups = tuple(params), tuple(groups)
        self.stats: dict[TensorKind, np.ndarray] = {
            cast("TensorKind", k): read_only(v) for k, v in stats.items()
        }
        by_kind: Mapping[Any, np.ndarray] = counts
        self.counts: dict[TensorKind, np.ndarray] = {k: read_only(by_kind[k]) for k in self.stats}
        self.norm_type = norm_type
        self.extras = extras
        self._numel: np.ndarray | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt through __init__, so that the columns are read-only again after the scaled-out
        check has sent loaded ranks to another process."""
        return (_rebuild, (*self._columns(), self.extras))

    def _columns(self) -> tuple[Any, ...]:
        """The constructor's positional arguments: the columns without the extras."""
        return (self.rows, self.coords, self.params, self.groups, self.stats, self.counts, self.norm_type)

    @property
    def kinds(self) -> tuple[TensorKind, ...]:
        return cast("tuple[TensorKind, ...]", tuple(self.stats))  # validated against TENSOR_KINDS

    @property
    def fingerprint_length(self) -> int:
        return int(next(iter(self.stats.values())).shape[1]) - 3 if self.stats else 0

    @property
    def stats_only(self) -> bool:
        """Whether the columns hold these pieces whole: statistics of one kind set, fingerprint
        length and norm type, one flat range or box each, nothing else (format 1.1 can store them)."""
        widths = {int(v.shape[1]) for v in self.stats.values()}
        return bool(len(self) and self.stats and len(widths) == 1 and self.extras.empty)

    @property
    def tensor_kinds(self) -> tuple[TensorKind, ...]:
        """The kinds some piece holds values of (a key in the safetensors file)."""
        return tuple(kind for kind, keys in self.extras.tensors.items() if keys)

    @property
    def holds_flat_range(self) -> bool:
        """Whether some piece's region is a flat range (ndim 0 in the columns, or among its extra regions)."""
        extra = self.extras.regions
        plain = np.ones(len(self), dtype=bool)
        plain[list(extra)] = False
        return bool((plain & (self.rows[:, 3] == 0)).any()) or any(
            isinstance(region, FlatRange) for regions in extra.values() for region in regions
        )

    def with_tensors(self, tensors: Mapping[TensorKind, Mapping[int, str]]) -> ColumnarPieces:
        """These pieces naming the tensors `tensors` (kind -> position -> key) too."""
        merged = {k: dict(v) for k, v in self.extras.tensors.items()}
        for kind, keys in tensors.items():
            merged.setdefault(kind, {}).update(keys)
        extras = dataclasses.replace(self.extras, tensors={k: v for k, v in merged.items() if v})
        return ColumnarPieces(*self._columns(), extras=extras)

    @property
    def numel(self) -> np.ndarray:
        """Elements of each piece."""
        if self._numel is None:
            rows, coords = self.rows, self.coords
            first, ndim = rows[:, 2], rows[:, 3]
            numel = np.zeros(len(rows), dtype=np.int64)
            flat = ndim == 0
            numel[flat] = coords[first[flat] + 1] - coords[first[flat]]
            for k in np.unique(ndim[~flat]).tolist():
                chosen = np.flatnonzero(ndim == k)
                numel[chosen] = np.prod(coords[first[chosen, None] + k + np.arange(k)], axis=1)
            for position, regions in self.extras.regions.items():
                numel[position] = sum(r.numel for r in regions)
            self._numel = read_only(numel)
        return self._numel

    def regions(self) -> list[tuple[Region, ...]]:
        """`Piece.regions` of every piece, in position order, without building the pieces."""
        coords, extra, found = self.coords.tolist(), self.extras.regions, []
        for at, (_, _, first, ndim) in enumerate(self.rows.tolist()):
            if at in extra:
                found.append(extra[at])
            elif ndim == 0:
                found.append((FlatRange(start=coords[first], stop=coords[first + 1]),))
            else:
                offsets, shape = coords[first : first + ndim], coords[first + ndim : first + 2 * ndim]
                found.append((Box(offsets=tuple(offsets), shape=tuple(shape)),))
        return found

    def local_shape(self, position: int) -> tuple[int, ...]:
        """`Piece.local_shape` of the piece at `position`, without building the piece."""
        shape = self.extras.local_shapes.get(position)
        if shape is not None:
            return shape
        if position in self.extras.regions:
            return (int(self.numel[position]),)
        _, _, first, ndim = self.rows[position].tolist()
        if ndim == 0:
            start, stop = self.coords[first : first + 2].tolist()
            return (stop - start,)
        return tuple(self.coords[first + ndim : first + 2 * ndim].tolist())

    def layout_column(self, column: int, width: int) -> np.ndarray:
        """Column `column` of [n, 2 + width]: param index, ndim, then the region's coordinates padded
        with -1: rows are equal exactly when the pieces' layout keys are (for the same parameter
        table; pieces of one flat range or box each)."""
        rows = self.rows
        if column < 2:
            return rows[:, 0] if column == 0 else rows[:, 3]
        first, ndim = rows[:, 2], rows[:, 3]
        if column < 4 and not ndim.any():  # flat ranges only: [start, stop)
            found: np.ndarray = self.coords[first + column - 2]
            return found
        span = np.where(ndim == 0, 2, 2 * ndim)
        inside = column - 2 < span
        return np.where(inside, self.coords[np.where(inside, first + column - 2, 0)], -1)

    @property
    def layout_width(self) -> int:
        return max(2, 2 * int(self.rows[:, 3].max())) if len(self.rows) else 2

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @overload
    def __getitem__(self, index: int) -> Piece: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Piece, ...]: ...

    def __getitem__(self, index: int | slice) -> Piece | tuple[Piece, ...]:
        if isinstance(index, slice):
            return tuple(self.build(range(len(self))[index]))
        position = operator.index(index)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"piece index {index} out of range")
        return self.build([position])[0]

    def __iter__(self) -> Iterator[Piece]:
        n = len(self)
        for start in range(0, n, _BATCH):
            yield from self.build(range(start, min(n, start + _BATCH)))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if (
            isinstance(other, ColumnarPieces)
            and len(self) == len(other)
            and (
                self.params == other.params
                and self.groups == other.groups
                and self.kinds == other.kinds
                and self.norm_type == other.norm_type
                and self.extras == other.extras
                and np.array_equal(self.rows, other.rows)
                and np.array_equal(self.coords, other.coords)
                and all(np.array_equal(self.stats[k], other.stats[k]) for k in self.kinds)
                and all(np.array_equal(self.counts[k], other.counts[k]) for k in self.kinds)
            )
        ):
            return True
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ColumnarPieces({len(self)} pieces)"

    def build(self, positions: Iterable[int]) -> list[Piece]:
        """The pieces at these positions, as validated objects."""
        params, coords, counts, extras = self.params, self.coords, self.counts, self.extras
        norm_type = self.norm_type
        chosen = np.fromiter(positions, dtype=np.int64)
        group_names: list[str | None] = [*self.groups, None]  # index -1: no group
        stats_rows = [
            (
                kind,
                values[chosen].tolist(),
                counts[kind][chosen].tolist(),
                extras.absent.get(kind, frozenset()),
            )
            for kind, values in self.stats.items()
        ]
        pieces = []
        for at, (position, (param_index, group, first, ndim)) in enumerate(
            zip(chosen.tolist(), self.rows[chosen].tolist(), strict=True)
        ):
            info = params[param_index]
            regions: tuple[Region, ...]
            if position in extras.regions:
                regions = extras.regions[position]
                numel = sum(r.numel for r in regions)
                local_shape: tuple[int, ...] = (numel,)
            elif ndim == 0:
                start, stop = coords[first : first + 2].tolist()
                numel = stop - start
                regions, local_shape = (FlatRange(start=start, stop=stop),), (numel,)
            else:
                values = coords[first : first + 2 * ndim].tolist()
                offsets, shape = tuple(values[:ndim]), tuple(values[ndim:])
                regions, local_shape, numel = (Box(offsets=offsets, shape=shape),), shape, math.prod(shape)
            piece_stats: dict[TensorKind, TensorStats] = {}
            for kind, kind_rows, kind_counts, absent in stats_rows:
                if position in absent:
                    continue
                odd = extras.odd_stats.get((position, kind)) if extras.odd_stats else None
                if odd is not None:
                    piece_stats[kind] = odd
                    continue
                row = kind_rows[at]
                nan, posinf, neginf = kind_counts[at]
                sum_pow, sum_sq = row[0], row[1]
                if sum_pow == sum_sq and sum_pow:  # the L2 norm's two sums: one float (24 B a piece)
                    sum_pow = sum_sq
                piece_stats[kind] = TensorStats(
                    numel=numel,
                    norm_type=norm_type,
                    sum_pow=sum_pow,
                    sum_sq=sum_sq,
                    max_abs=row[2],
                    num_nan=nan,
                    num_posinf=posinf,
                    num_neginf=neginf,
                    fingerprint=tuple(row[3:]),
                )
            pieces.append(
                Piece(
                    index=position,
                    param=info.name,
                    regions=regions,
                    local_shape=extras.local_shapes.get(position, local_shape),
                    dtype=extras.dtypes.get(position, info.dtype),
                    local_name=extras.local_names.get(position),
                    replica_group=group_names[group],
                    tensors={k: keys[position] for k, keys in extras.tensors.items() if position in keys},
                    stats=piece_stats,
                    call_stats=extras.call_stats.get(position, ()),
                    partial_group=extras.partial_groups.get(position),
                )
            )
        return pieces


_BATCH = 1024


def _rebuild(*args: Any) -> ColumnarPieces:
    *columns, extras = args
    return ColumnarPieces(*columns, extras=extras)


def as_columns(params: Sequence[ParamInfo], pieces: Sequence[Piece]) -> ColumnarPieces:
    """`pieces` (of parameters in `params`) as columns: the one conversion of Piece objects."""
    columns = PieceColumnsBuilder(params)
    for piece in pieces:
        columns.add(piece)
    return columns.result()


class PieceColumnsBuilder:
    """The columns of pieces as lists (or arrays), filled a piece at a time from Piece objects
    (`add`) or a column at a time by the format-1.0 decoder (dumpfile/columnar.py), then
    `result()`: the columns, and what they have no place for in `PieceExtras`."""

    def __init__(self, params: Sequence[ParamInfo]) -> None:
        self.params = tuple(params)
        self.index_of = {info.name: i for i, info in enumerate(self.params)}
        self.param: list[int] | np.ndarray = []
        """Per piece: its parameter's index in `params`; then its replica group, the position of
        its region's first coordinate in `coords` and the region's ndim (0: a flat range)."""
        self.groups: list[str | None] = []
        self.first: list[int] | np.ndarray = []
        self.ndim: list[int] | np.ndarray = []
        self.coords: list[int] | np.ndarray = []
        self.norm_type: float | None = None
        self.stats: dict[TensorKind, tuple[int, Any, Any, Any]] = {}
        """Kind -> (fingerprint length, the positions that have it, their sum_pow, sum_sq, max_abs
        and fingerprint rows, their num_nan, num_posinf, num_neginf rows)."""
        self.tensors: dict[TensorKind, dict[int, str]] = {}
        self.odd: dict[tuple[int, TensorKind], TensorStats] = {}
        self.extra: dict[str, dict[int, Any]] = {f.name: {} for f in dataclasses.fields(PieceExtras)[3:]}
        """PieceExtras' fields by position (those after tensors, absent and odd_stats), by name."""

    def add(self, piece: Piece) -> None:
        param_index = self.index_of.get(piece.param)
        if param_index is None:
            raise ValueError(f"piece {piece.index} is of {piece.param!r}, which is not in the dump's params")
        if piece.index != len(self.param):
            raise ValueError(
                f"piece {piece.index} is at position {len(self.param)}: pieces are numbered in order"
            )
        params, firsts, ndims, coords = cast(
            "tuple[list[int], ...]", (self.param, self.first, self.ndim, self.coords)
        )
        position, regions, local_shape, extra = len(params), piece.regions, piece.local_shape, self.extra
        region = regions[0] if len(regions) == 1 else None
        numel = math.prod(local_shape)
        implied: tuple[int, ...] = (numel,)
        params.append(param_index)
        self.groups.append(piece.replica_group)
        firsts.append(len(coords))
        if type(region) is Box and region.shape:
            ndims.append(len(region.shape))
            coords += (*region.offsets, *region.shape)
            implied = region.shape
        else:
            ndims.append(0)
            if type(region) is FlatRange:
                coords += (region.start, region.stop)
            else:
                coords += (0, 0)
                extra["regions"][position] = regions
        if local_shape != implied:
            extra["local_shapes"][position] = local_shape
        if piece.dtype != self.params[param_index].dtype:
            extra["dtypes"][position] = piece.dtype
        if piece.call_stats:
            extra["call_stats"][position] = piece.call_stats
        if piece.local_name is not None:
            extra["local_names"][position] = piece.local_name
        if piece.partial_group is not None:
            extra["partial_groups"][position] = piece.partial_group
        for kind, key in piece.tensors.items():
            self.tensors.setdefault(kind, {})[position] = key
        for kind, s in piece.stats.items():
            if self.norm_type is None:
                self.norm_type = s.norm_type
            width, positions, values, counts = self.stats.setdefault(kind, (len(s.fingerprint), [], [], []))
            fingerprint = s.fingerprint[:width] + (0.0,) * (width - len(s.fingerprint))
            positions.append(position)
            values.append((s.sum_pow, s.sum_sq, s.max_abs, *fingerprint))
            counts.append((s.num_nan, s.num_posinf, s.num_neginf))
            if not (
                (s.norm_type == self.norm_type or (math.isnan(s.norm_type) and math.isnan(self.norm_type)))
                and len(s.fingerprint) == width
                and s.numel == numel
            ):
                self.odd[(position, kind)] = s

    def result(self) -> ColumnarPieces:
        n = len(self.param)
        groups = sorted({g for g in self.groups if g is not None})
        group_index: dict[str | None, int] = {g: i for i, g in enumerate(groups)}
        group_index[None] = -1
        rows = np.zeros((n, 4), dtype=np.int64)
        rows[:, 0], rows[:, 2], rows[:, 3] = self.param, self.first, self.ndim
        rows[:, 1] = [group_index[g] for g in self.groups]
        values, counted, absent = {}, {}, {}
        for kind in sorted(self.stats):
            width, positions, kind_values, kind_counts = self.stats[kind]
            values[kind] = np.zeros((n, 3 + width), dtype=np.float64)
            counted[kind] = np.zeros((n, 3), dtype=np.int64)
            values[kind][positions] = np.asarray(kind_values, dtype=np.float64).reshape(
                len(positions), 3 + width
            )
            counted[kind][positions] = np.asarray(kind_counts, dtype=np.int64).reshape(len(positions), 3)
            if len(positions) < n:
                absent[kind] = frozenset(range(n)) - frozenset(np.asarray(positions).tolist())
        extras = PieceExtras(tensors=self.tensors, absent=absent, odd_stats=self.odd, **self.extra)
        return ColumnarPieces(
            rows,
            np.asarray(self.coords, dtype=np.int64),
            self.params,
            groups,
            values,
            counted,
            self.norm_type if self.norm_type is not None else 2.0,
            extras=extras if not extras.empty else NO_EXTRAS,
        )
