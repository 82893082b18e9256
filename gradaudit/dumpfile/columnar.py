"""Dump format 1.1: the pieces of a stats-only rank file as binary columns (safetensors arrays).

A many-rank stats dump is millions of small pieces; as JSON each costs about 550 header bytes and a
dict to decode. In 1.1 a rank file whose pieces all hold statistics only (no tensor values) and
one region each stores them as arrays beside an empty JSON "pieces" list, described by the
document's "columnar" entry (see docs/FORMAT.md):

    __gradaudit__.pieces        I64 [n, 4]   param index, replica group index (-1: none),
                                             first coordinate in __gradaudit__.coords, ndim
                                             (0: a flat range [start, stop), k: a k-D box)
    __gradaudit__.coords        I64 [c]      start, stop  |  offsets..., shape...
    __gradaudit__.stats.KIND    F64 [n, 3+f] sum_pow, sum_sq, max_abs, fingerprint...
    __gradaudit__.counts.KIND   I64 [n, 3]   num_nan, num_posinf, num_neginf

The parameter table goes beside them as columns too (an empty JSON "params" list):

    __gradaudit__.params.names  U8  [b]      the names, UTF-8, one after the other
    __gradaudit__.params.meta   I64 [m, 3]   end of the name in .names, ndim, dtype code
                                             (the index in model.FLOAT_DTYPES)
    __gradaudit__.params.dims   I64 [d]      the global shapes, one after the other

Every rank of a step writes the same table, so the loader decodes it once per step (a cache keyed
by its bytes) and all ranks share one tuple of ParamInfo.

`to_columns` gives None for a dump it cannot store losslessly (then the JSON form is written);
`from_columns` validates every column against the parameter table as a whole and keeps the pieces
as columns (dump.ColumnarPieces, the one form of every rank's pieces): a Piece object is built
only when one is indexed or iterated.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from ..errors import DumpFormatError, clipped, shown
from ..model import (
    FLOAT_DTYPES,
    TENSOR_KINDS,
    Box,
    FlatRange,
    ParamInfo,
    Region,
    TensorKind,
    TensorStats,
    Topology,
)
from .dump import ColumnarPieces, PieceColumnsBuilder, RankDump
from .header import PREFIX as PREFIX  # the column keys; reader.py imports it from here

__all__ = ["ColumnarPieces", "ParamIds", "from_columns", "pieces_from_rows", "to_columns"]

PIECES, COORDS = PREFIX + "pieces", PREFIX + "coords"
NAMES, META, DIMS = PREFIX + "params.names", PREFIX + "params.meta", PREFIX + "params.dims"
MAX_FINGERPRINT = 64
MAX_DIMS = 64
MAX_ELEMENTS = 2**53
"""No shape may claim more elements than this; nothing is ever allocated from a claimed shape."""
MAX_INT = 2**63 - 1
"""Counters (step, tokens, element counts) must fit in a signed 64-bit integer."""
MAX_LIST = 10_000_000
"""The most entries any list in the metadata may hold unless a field says otherwise."""
MAX_CLIP_CALLS = 10_000
"""Clip calls before one optimizer step: one per microbatch at the very most."""

Fail = Callable[[str], DumpFormatError]


class ParamsCache:
    """What the ranks of one load share: decoded parameter tables, by the very arrays (the ranks naming
    one shared table file hand over the same three), else by their bytes; and the last piece table
    (`__gradaudit__.pieces`) found valid, with what its checks derive (the ranks of a step usually
    hold pieces of the same parameters laid out alike)."""

    def __init__(self) -> None:
        self.by_bytes: dict[bytes, tuple[ParamInfo, ...]] = {}
        self.by_arrays: list[tuple[tuple[np.ndarray, ...], tuple[ParamInfo, ...]]] = []
        """The last arrays decoded, held so that they are not freed (identity compared)."""
        self.rows: tuple[np.ndarray, int, Sequence[ParamInfo], int, _Extents] | None = None
        """(rows, coordinate count, parameters, number of replica groups, extents) last found valid."""
        self.topology: tuple[Any, int, Topology] | None = None
        """(the JSON "topology" entry, the world size, its Topology) last decoded: every rank's file
        lists the groups of every rank, the same entry (schema.decode_rank)."""

    def valid_rows(
        self, rows: np.ndarray, coords: np.ndarray, params: Sequence[ParamInfo], num_groups: int
    ) -> _Extents | None:
        known = self.rows
        if known is None or known[1] != coords.size or known[3] != num_groups:
            return None
        if not (known[2] is params or known[2] == params) or not np.array_equal(known[0], rows):
            return None
        return known[4]

    def of_arrays(self, arrays: tuple[np.ndarray, ...]) -> tuple[ParamInfo, ...] | None:
        for known, params in self.by_arrays:
            if all(a is b for a, b in zip(known, arrays, strict=True)):
                return params
        return None

    def add(self, key: bytes, arrays: tuple[np.ndarray, ...], params: tuple[ParamInfo, ...]) -> None:
        self.by_bytes[key] = params
        self.by_arrays = [(arrays, params), *self.by_arrays[:7]]


def params_to_columns(params: Sequence[ParamInfo]) -> dict[str, np.ndarray]:
    """The parameter table as columns (each dtype one of FLOAT_DTYPES)."""
    names = [p.name.encode("utf-8") for p in params]
    ends = np.cumsum([len(n) for n in names], dtype=np.int64)
    meta = np.stack(
        [
            ends,
            np.array([len(p.global_shape) for p in params], dtype=np.int64),
            np.array([FLOAT_DTYPES.index(p.dtype) for p in params], dtype=np.int64),
        ],
        axis=1,
    )
    return {
        NAMES: np.frombuffer(b"".join(names), dtype=np.uint8).copy(),
        META: meta,
        DIMS: np.array([d for p in params for d in p.global_shape], dtype=np.int64),
    }


def params_from_columns(
    arrays: Mapping[str, np.ndarray], path: str, cache: ParamsCache | None
) -> tuple[ParamInfo, ...]:
    """The parameter table stored as columns; decoded once per distinct table when `cache` is given."""

    def fail(problem: str) -> DumpFormatError:
        return DumpFormatError(
            path, f"columnar parameters: {problem}", "the file is not a valid gradaudit dump"
        )

    names, meta, dims = arrays.get(NAMES), arrays.get(META), arrays.get(DIMS)
    if names is None or meta is None or dims is None:
        raise fail("a parameter column is missing")
    if (
        names.dtype != np.uint8
        or names.ndim != 1
        or meta.dtype != np.int64
        or meta.ndim != 2
        or meta.shape[1] != 3
    ):
        raise fail("a parameter column has the wrong dtype or shape")
    if dims.dtype != np.int64 or dims.ndim != 1:
        raise fail("a parameter column has the wrong dtype or shape")
    same = None if cache is None else cache.of_arrays((names, meta, dims))
    if same is not None:
        return same
    key = names.tobytes() + meta.tobytes() + dims.tobytes()
    if cache is not None and key in cache.by_bytes:
        cache.add(key, (names, meta, dims), cache.by_bytes[key])
        return cache.by_bytes[key]
    ends, ndims, codes = meta[:, 0], meta[:, 1], meta[:, 2]
    if meta.shape[0] == 0:
        raise fail("the table is empty")
    # Signs and bounds first, differences after: np.diff of arbitrary int64 values can wrap around.
    if (ends < 0).any() or (ends > names.size).any() or (np.diff(ends, prepend=0) < 0).any():
        raise fail("name offsets do not cover the names")
    if int(ends[-1]) != names.size:
        raise fail("name offsets do not cover the names")
    if ((ndims < 0) | (ndims > MAX_DIMS)).any() or int(ndims.sum()) != dims.size or (dims < 0).any():
        raise fail("shapes do not match their dimension counts")
    if ((codes < 0) | (codes >= len(FLOAT_DTYPES))).any():
        raise fail("a dtype code is not one of model.FLOAT_DTYPES")
    raw = names.tobytes()
    dims_list, infos, seen = dims.tolist(), [], set()
    start_name, start_dim = 0, 0
    for end, ndim, code in meta.tolist():
        try:
            name = raw[start_name:end].decode("utf-8")
        except UnicodeDecodeError:
            raise fail(f"the name ending at byte {end} is not UTF-8") from None
        shape = tuple(dims_list[start_dim : start_dim + ndim])
        start_name, start_dim = end, start_dim + ndim
        if name in seen:
            raise fail(f"parameter {name!r:.60} is listed twice")
        if math.prod(shape) > MAX_ELEMENTS:
            raise fail(f"parameter {name!r:.60} claims more elements than any real tensor")
        seen.add(name)
        infos.append(ParamInfo(name=name, global_shape=shape, dtype=FLOAT_DTYPES[code]))
    result = tuple(infos)
    if cache is not None:
        cache.add(key, (names, meta, dims), result)
    return result


def stats_key(kind: TensorKind) -> str:
    return f"{PREFIX}stats.{kind}"


def counts_key(kind: TensorKind) -> str:
    return f"{PREFIX}counts.{kind}"


def to_columns(dump: RankDump) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """(the "columnar" descriptor, the arrays by key) of `dump`'s pieces, their parameter table
    included, or None when the columns would not hold them whole (tensors, several regions, a local
    name, a dtype other than its parameter's, differing norm types or fingerprint lengths:
    `ColumnarPieces.stats_only`) or a dtype has no code (the JSON form, which the writer's own
    check then refuses with the reader's words)."""
    pieces = dump.pieces
    if not pieces.stats_only or any(p.dtype not in FLOAT_DTYPES for p in pieces.params):
        return None
    arrays: dict[str, np.ndarray] = {PIECES: pieces.rows, COORDS: pieces.coords}
    for kind in pieces.kinds:
        arrays[stats_key(kind)] = pieces.stats[kind]
        arrays[counts_key(kind)] = pieces.counts[kind]
    arrays.update(params_to_columns(pieces.params))
    norm_type = pieces.norm_type
    descriptor = {
        "params": "columns",
        "num_pieces": len(pieces),
        "kinds": list(pieces.kinds),
        "norm_type": "inf" if math.isinf(norm_type) else norm_type,
        "fingerprint_length": pieces.fingerprint_length,
        "replica_groups": list(pieces.groups),
    }
    return descriptor, arrays


def pieces_from_rows(
    *,
    params: Sequence[ParamInfo],
    param_names: Sequence[str],
    groups: Sequence[str | None],
    ndims: Sequence[int],
    coords: Sequence[int],
    rows: Mapping[str, np.ndarray],
    norm_type: float,
) -> ColumnarPieces:
    """Pieces as columns from lists, one entry a piece: its parameter's name (in `params`), replica
    group, region (`ndims`: 0 for a flat range, else the box's; `coords` laid out piece after piece)
    and, per kind, a float64 row (sum_pow, sum_sq, max_abs, the fingerprint, num_nan, num_posinf,
    num_neginf). Not validated here: the writer checks the columns as the reader does."""
    columns, ndim = PieceColumnsBuilder(params), np.array(ndims, dtype=np.int64)
    columns.param = [columns.index_of[name] for name in param_names]
    columns.groups, columns.ndim = list(groups), ndim
    columns.first = _starts(np.where(ndim == 0, 2, 2 * ndim))
    columns.coords, columns.norm_type = np.asarray(coords, dtype=np.int64), float(norm_type)
    everyone = np.arange(ndim.size)
    columns.stats = {
        cast("TensorKind", k): (v.shape[1] - 6, everyone, v[:, :-3], v[:, -3:]) for k, v in rows.items()
    }
    return columns.result()


def from_columns(
    descriptor: Any,
    arrays: Mapping[str, np.ndarray],
    params: Sequence[ParamInfo],
    path: str,
    cache: ParamsCache | None = None,
) -> ColumnarPieces:
    """The pieces the columns describe, after checking every column (DumpFormatError naming `path`);
    `cache` skips the checks of a piece table the load found valid already."""

    def fail(problem: str) -> DumpFormatError:
        return DumpFormatError(path, f"columnar pieces: {problem}", "the file is not a valid gradaudit dump")

    if not isinstance(descriptor, dict):
        raise fail("the 'columnar' entry is not an object")
    n, kinds, fp_len = (
        descriptor.get("num_pieces"),
        descriptor.get("kinds"),
        descriptor.get("fingerprint_length"),
    )
    groups, norm_type = descriptor.get("replica_groups", []), descriptor.get("norm_type")
    if not (type(n) is int and n > 0 and type(fp_len) is int and 0 <= fp_len <= MAX_FINGERPRINT):
        raise fail("num_pieces or fingerprint_length is not a valid count")
    if not (isinstance(kinds, list) and kinds and all(k in TENSOR_KINDS for k in kinds)):
        raise fail(f"kinds {kinds!r:.80} are not tensor kinds")
    if not (isinstance(groups, list) and all(isinstance(g, str) for g in groups)):
        raise fail("replica_groups is not a list of names")
    norm_type = math.inf if norm_type == "inf" else norm_type
    if not (isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool) and norm_type > 0):
        raise fail(f"norm_type {norm_type!r:.40} is not positive")
    expected: dict[str, tuple[Any, tuple[int, ...] | None]] = {
        PIECES: (np.int64, (n, 4)),
        COORDS: (np.int64, None),
    }
    for kind in kinds:
        expected[stats_key(kind)] = (np.float64, (n, 3 + fp_len))
        expected[counts_key(kind)] = (np.int64, (n, 3))
    for key, (dtype, shape) in expected.items():
        array = arrays.get(key)
        if array is None:
            raise fail(f"tensor {key} is missing")
        if (
            array.dtype != dtype
            or (shape is not None and array.shape != shape)
            or (shape is None and array.ndim != 1)
        ):
            raise fail(f"tensor {key} has dtype {array.dtype} and shape {list(array.shape)}")
    for key in arrays:
        if key not in expected and key not in (NAMES, META, DIMS):
            raise fail(f"tensor {key} is not one the 'columnar' entry describes")
    rows, coords = arrays[PIECES], arrays[COORDS]
    extents = None if cache is None else cache.valid_rows(rows, coords, params, len(groups))
    if extents is None:
        _check_rows(rows, coords, params, len(groups), fail)
        extents = _Extents(rows[:, 0], rows[:, 2], rows[:, 3], rows[:, 3] == 0, params)
        if cache is not None:
            cache.rows = (rows, coords.size, params, len(groups), extents)
    for kind in kinds:
        values, counted = arrays[stats_key(kind)], arrays[counts_key(kind)]
        if not (values[:, :3] >= 0).all():  # nan compares False too
            raise fail(f"{kind} sums and max |x| must be non-negative numbers")
        if (counted < 0).any():
            raise fail(f"{kind} nonfinite counts must be non-negative")
    stats = {k: arrays[stats_key(k)] for k in kinds}
    counts = {k: arrays[counts_key(k)] for k in kinds}
    _check_extents(extents, rows, coords, params, counts, fail)
    return ColumnarPieces(rows, coords, params, groups, stats, counts, float(norm_type))


def _check_rows(
    rows: np.ndarray, coords: np.ndarray, params: Sequence[ParamInfo], num_groups: int, fail: Fail
) -> None:
    if len(params) == 0:
        raise fail("the file lists no parameters")
    param, group, first, ndim = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3]
    if ((param < 0) | (param >= len(params))).any():
        raise fail("a parameter index is outside the parameter list")
    if ((group < -1) | (group >= num_groups)).any():
        raise fail("a replica group index is outside replica_groups")
    dims = _param_columns(params)[0][param]
    flat = ndim == 0
    if ((~flat) & (ndim != dims)).any():
        raise fail("a box has another number of dimensions than its parameter")
    width = np.where(flat, 2, 2 * ndim)
    expected_first = np.concatenate(([0], np.cumsum(width)[:-1]))
    if (first != expected_first).any() or int(width.sum()) != coords.size:
        raise fail("coordinates are not laid out piece after piece")


_last_params: tuple[Sequence[ParamInfo], tuple[np.ndarray, np.ndarray]] = ((), (np.zeros(0), np.zeros(0)))


def _param_columns(params: Sequence[ParamInfo]) -> tuple[np.ndarray, np.ndarray]:
    """(ndim, numel) of each parameter, kept for the next rank (the ranks of a step share a table)."""
    global _last_params
    known, columns = _last_params
    if not (known is params or known == params):
        columns = (
            np.array([len(p.global_shape) for p in params], dtype=np.int64),
            np.array([p.numel for p in params], dtype=np.int64),
        )
        _last_params = (params, columns)
    return columns


class _Extents:
    """What the extent checks read of a valid table of regions (each a parameter index, its first
    coordinate, its ndim and whether it is a flat range): the flat ones, where their ranges start,
    their parameters' element counts, and the boxes."""

    def __init__(
        self,
        param: np.ndarray,
        first: np.ndarray,
        ndim: np.ndarray,
        flat: np.ndarray,
        params: Sequence[ParamInfo],
    ) -> None:
        self.param, self.first_of, self.ndim = param, first, ndim
        self.flat = np.flatnonzero(flat)
        self.first = first[self.flat]
        self.limit = _param_columns(params)[1][param[self.flat]]
        self.boxes = np.flatnonzero(~flat)


def region_extents(
    extents: _Extents, coords: np.ndarray, params: Sequence[ParamInfo]
) -> tuple[np.ndarray, np.ndarray]:
    """(outside, numel) of every region at once, in both formats: whether it lies outside its
    parameter (a box of another number of dimensions too), and its elements (0 when outside)."""
    start, stop = coords[extents.first], coords[extents.first + 1]
    bad = (start < 0) | (start > stop) | (stop > extents.limit)
    if not extents.boxes.size:
        return bad, np.where(bad, 0, stop - start)
    outside = np.zeros(extents.param.size, dtype=bool)
    numel = np.zeros(extents.param.size, dtype=np.int64)
    outside[extents.flat], numel[extents.flat] = bad, np.where(bad, 0, stop - start)
    boxes = extents.boxes
    param, first, ndim = extents.param[boxes], extents.first_of[boxes], extents.ndim[boxes]
    param_ndims = _param_columns(params)[0]
    for k in np.unique(ndim).tolist():
        chosen = np.flatnonzero(ndim == k)
        offsets = coords[first[chosen, None] + np.arange(k)]
        shape = coords[first[chosen, None] + k + np.arange(k)]
        limits = np.array(
            [p.global_shape if len(p.global_shape) == k else (0,) * k for p in params], dtype=np.int64
        )
        dims = limits.reshape(len(params), k)[param[chosen]]
        # `shape > dims - offsets`, not `offsets + shape > dims`: with both below 2^63 the difference
        # cannot wrap around, the sum can (offsets [2^62] + shape [2^62] is negative in int64).
        out = (param_ndims[param[chosen]] != k) | (
            (offsets < 0) | (shape < 0) | (offsets > dims) | (shape > dims - offsets)
        ).any(axis=1)
        outside[boxes[chosen]] = out
        # Inside its parameter, a box's product is at most the parameter's (2^53): no wrap-around.
        numel[boxes[chosen]] = np.prod(np.where(out[:, None], 0, shape), axis=1, dtype=np.int64)
    return outside, numel


def _check_extents(
    extents: _Extents,
    rows: np.ndarray,
    coords: np.ndarray,
    params: Sequence[ParamInfo],
    counts: Mapping[str, np.ndarray],
    fail: Fail,
) -> None:
    """Ranges and boxes inside their parameter and nonfinite counts within each piece's elements,
    for all pieces at once; the first bad piece is named, outside before too many nonfinite values."""
    outside, numel = region_extents(extents, coords, params)
    if outside.any():
        i = int(np.argmax(outside))
        k, at, name = int(rows[i, 3]), int(rows[i, 2]), params[int(rows[i, 0])].name
        if k == 0:
            raise fail(f"piece {i}: range [{coords[at]}, {coords[at + 1]}) is outside {name!r:.60}")
        offsets, shape = coords[at : at + k].tolist(), coords[at + k : at + 2 * k].tolist()
        raise fail(f"piece {i}: box {offsets} + {shape} is outside {name!r:.60}")
    for kind, counted in counts.items():
        if counted.any() and (over := _more_than(counted, numel)).any():
            i = int(np.argmax(over))
            raise fail(
                f"piece {i}: more nonfinite {kind + ' ' if rows[i, 3] == 0 else ''}values than elements"
            )


def _more_than(counted: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Rows whose nonfinite counts (nan, +inf, -inf) add up to more than `numel` (at most 2^53): each
    count is compared alone first, so that the sum of three, each then at most 2^53, cannot wrap."""
    each_over = (counted > numel[:, None]).any(axis=1)
    over: np.ndarray = each_over | (np.minimum(counted, numel[:, None]).sum(axis=1) > numel)
    return over


class ParamIds:
    """Each ColumnarPieces' parameter indices as indices into one list of names shared by a step's
    ranks (every rank of a step usually holds the same table: it is mapped once)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.ids = {name: i for i, name in enumerate(names)}
        self._seen: list[tuple[tuple[ParamInfo, ...], np.ndarray]] = []

    def of(self, pieces: ColumnarPieces) -> np.ndarray:
        """The step-wide id of each piece's parameter."""
        ids: np.ndarray = self.table(pieces.params)[pieces.rows[:, 0]]
        return ids

    def table(self, params: tuple[ParamInfo, ...]) -> np.ndarray:
        for known, mapping in self._seen:
            if known is params or known == params:
                return mapping
        ids = self.ids
        mapping = np.array([ids.setdefault(p.name, len(ids)) for p in params], dtype=np.int64)
        self._seen.append((params, mapping))
        return mapping


# ---------------------------------------------------------------- format 1.0: JSON pieces as columns


_ABSENT = object()
"""A field the entry does not have (its message says "missing")."""
_Type = tuple[frozenset[type], Any, str]
"""What a field must be: its types, what a wrong value is replaced by (never changed), in words."""
_DICT: _Type = (frozenset({dict}), {}, "an object")
_LIST: _Type = (frozenset({list}), [], "a list")
_SHAPE: _Type = (frozenset({list}), [], f"a list of at most {MAX_DIMS} integers")
_STR: _Type = (frozenset({str}), None, "a string")
_OPTIONAL_STR: _Type = (frozenset({str, type(None)}), None, "a string")
_INT, _FLOAT = frozenset({int}), frozenset({float})

_Where = str | Callable[[int], str]
"""The field under `pieces[i]` a check names: one for every row, or the row's (by its index)."""


def _named(where: _Where, row: int) -> str:
    return where if isinstance(where, str) else where(row)


def kind_of(value: Any) -> str:
    """How an error names the JSON type of an untrusted value."""
    return _KIND_NAMES.get(type(value), "a number")


_KIND_NAMES = {type(None): "null", dict: "an object", list: "a list", str: "a string", bool: "a boolean"}


class _Faults:
    """The first bad piece any column check found (`first`: the number of pieces when none yet) and
    what the first check to flag it says: (the field under `pieces[first]`, the problem)."""

    def __init__(self, n: int) -> None:
        self.first, self.why = n, ("", "")

    def flag(self, bad: np.ndarray, where: _Where, problem: Callable[[int], str], owner: Any = None) -> None:
        """Pieces (or rows of `owner`'s pieces, in piece order) where `bad` holds; `where` and
        `problem` say, from the first bad row's index, what is wrong with it."""
        at = np.flatnonzero(bad)
        if at.size:
            row = int(at[0])
            piece = row if owner is None else int(owner[row])
            if piece < self.first:
                self.first, self.why = piece, (_named(where, row), problem(row))

    def error(self, fail: Callable[[str, str], DumpFormatError]) -> DumpFormatError:
        return fail(f"pieces[{self.first}]{self.why[0]}", self.why[1])

    def typed(self, values: list[Any], of: _Type, where: _Where, owner: Any = None) -> list[Any]:
        """`values`, each not exactly of one of `of`'s types flagged and replaced by its default."""
        types, default, what = of
        if set(map(type, values)) <= types:
            return values
        bad = [type(v) not in types for v in values]
        self.flag(np.array(bad, dtype=bool), where, lambda i: _expected(what, values[i]), owner)
        return [default if b else v for v, b in zip(values, bad, strict=True)]

    def ints(self, values: list[Any], where: _Where, owner: Any = None) -> tuple[np.ndarray, bool]:
        """(`values` as int64, whether all were integers in [0, 2^63)); the others flagged and 0."""
        if set(map(type, values)) <= _INT:
            try:
                array = np.array(values, dtype=np.int64)
            except OverflowError:
                pass
            else:
                if not (array < 0).any():
                    return array, True
        ok = [type(v) is int and 0 <= v <= MAX_INT for v in values]
        self.flag(~np.array(ok, dtype=bool), where, lambda i: _int_problem(values[i]), owner)
        return np.array([v if k else 0 for v, k in zip(values, ok, strict=True)], dtype=np.int64), False

    def floats(self, values: list[Any], where: _Where, owner: Any = None) -> np.ndarray:
        """`values` as float64 (a number, or "nan", "inf", "-inf"); the others flagged and 0."""
        if set(map(type, values)) <= _FLOAT:
            return np.array(values, dtype=np.float64)
        found = [_float(v) for v in values]
        self.flag(
            np.array([f is None for f in found], dtype=bool),
            where,
            lambda i: _float_problem(values[i]),
            owner,
        )
        return np.array([0.0 if f is None else f for f in found], dtype=np.float64)


def _expected(what: str, value: Any) -> str:
    return "missing" if value is _ABSENT else f"expected {what}, got {kind_of(value)}"


def _int_problem(value: Any) -> str:
    if type(value) is not int:
        return _expected("an integer", value)
    return f"must be {'>= 0' if value < 0 else f'<= {MAX_INT}'}, got {clipped(str(value), 40)}"


def _must(what: str, raws: list[Any]) -> Callable[[int], str]:
    return lambda i: f"must be {what} number, got {shown(raws[i], 40)}"


def _too_many(counts: np.ndarray, limit: int) -> Callable[[int], str]:
    return lambda i: f"has {counts[i]} entries, more than {limit}"


def _float_problem(value: Any) -> str:
    if type(value) is int:
        return "is a number too large for a float64"
    return _expected("a number", value)


def _float(value: Any) -> float | None:
    if type(value) is str:
        return float(value) if value in ("nan", "inf", "-inf") else None
    try:
        return float(value) if type(value) in (int, float) else None
    except OverflowError:  # an integer beyond float64
        return None


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Where each of consecutive segments of these lengths starts."""
    return np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)


def _gather(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the segments [start, start + length), one after the other."""
    found: np.ndarray = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(
        starts - _starts(lengths), lengths
    )
    return found


def _segment(starts: np.ndarray, i: int) -> tuple[int, int]:
    """(which segment, the position in it) of entry `i` of segments starting at `starts`."""
    j = int(np.searchsorted(starts, i, side="right")) - 1
    return j, i - int(starts[j])


def _spans(regions: list[dict[str, Any]]) -> tuple[list[int], list[Any]]:
    """Each region entry's ndim (a box's, 0 and up; -1: a flat range; -2: neither) and all their
    coordinates one after the other (a box's offsets then shape, a range's start and stop, (0, 0)
    for neither), their values unchecked. One loop that allocates no object per region."""
    kinds: list[int] = []
    coords: list[Any] = []
    for region in regions:
        box = region.get("box", _ABSENT)
        if box is _ABSENT:
            bounds = region.get("range")
            if type(bounds) is list and len(bounds) == 2:
                kinds.append(-1)
                coords += bounds
                continue
        elif type(box) is dict:
            offsets, shape = box.get("offsets"), box.get("shape")
            if type(offsets) is list and type(shape) is list and len(offsets) == len(shape) <= MAX_DIMS:
                kinds.append(len(shape))
                coords += offsets
                coords += shape
                continue
        kinds.append(-2)
        coords += (0, 0)
    return kinds, coords


def _neither(region: dict[str, Any]) -> tuple[str, str]:
    """(the field, the problem) of a region entry `_spans` found neither a box nor a range."""
    if "box" in region:
        if type(region["box"]) is not dict:
            return ".box", _expected("an object", region["box"])
        return ".box", f"expected offsets and shape, lists of at most {MAX_DIMS} integers of one length"
    if "range" in region:
        return ".range", "expected [start, stop]"
    return "", 'expected a "box" or a "range"'


class _StatsColumns:
    """Statistics entries (of one kind of many pieces, or the call statistics) as columns, checked;
    `where` names the entry at a row (".stats.grad", ".call_stats[1]")."""

    def __init__(
        self, faults: _Faults, raws: list[Any], owner: np.ndarray, covered: np.ndarray, where: _Where
    ) -> None:
        raws = faults.typed(raws, _DICT, where, owner)

        def field(key: str, default: Any = _ABSENT) -> list[Any]:
            return [s.get(key, default) for s in raws]

        def at(key: str) -> Callable[[int], str]:
            return lambda i: f"{_named(where, i)}.{key}"

        self.owner = owner
        self.numel = faults.ints(field("numel"), at("numel"), owner)[0]
        raw_norms = field("norm_type")
        self.norm_type = faults.floats(raw_norms, at("norm_type"), owner)
        faults.flag(~(self.norm_type > 0), at("norm_type"), _must("a positive", raw_norms), owner)
        sums = []
        for key in ("sum_pow", "sum_sq", "max_abs"):
            raw = field(key)
            sums.append(faults.floats(raw, at(key), owner))
            faults.flag(~(sums[-1] >= 0), at(key), _must("a non-negative", raw), owner)  # nan: False too
        self.sums = np.stack(sums, axis=1)
        self.counts = np.stack([faults.ints(field(k, 0), at(k), owner)[0] for k in _COUNTS], axis=1)
        fingerprints = faults.typed(field("fingerprint", []), _LIST, at("fingerprint"), owner)
        self.lengths = np.fromiter(map(len, fingerprints), dtype=np.int64, count=len(raws))
        faults.flag(
            self.lengths > MAX_FINGERPRINT, at("fingerprint"), _too_many(self.lengths, MAX_FINGERPRINT), owner
        )
        values, value_starts = list(itertools.chain.from_iterable(fingerprints)), _starts(self.lengths)

        def value_at(v: int) -> str:
            row, k = _segment(value_starts, v)
            return f"{_named(where, row)}.fingerprint[{k}]"

        self.fingerprints = faults.floats(values, value_at, np.repeat(owner, self.lengths))
        holds = covered[owner]
        faults.flag(
            _more_than(self.counts, holds),
            where,
            lambda i: f"counts {sum(self.counts[i].tolist())} nonfinite values in {holds[i]} elements",
            owner,
        )
        faults.flag(
            self.numel != holds,
            at("numel"),
            lambda i: f"is {self.numel[i]} but the piece holds {holds[i]}",
            owner,
        )

    def objects(self, rows: Iterable[int]) -> list[TensorStats]:
        """The entries at these rows as TensorStats (the extras' call statistics, odd statistics)."""
        ends, values, found = np.cumsum(self.lengths).tolist(), self.fingerprints.tolist(), []
        for i in rows:
            (sum_pow, sum_sq, max_abs), (nan, posinf, neginf) = self.sums[i].tolist(), self.counts[i].tolist()
            found.append(
                TensorStats(
                    numel=int(self.numel[i]),
                    norm_type=float(self.norm_type[i]),
                    sum_pow=sum_pow,
                    sum_sq=sum_sq,
                    max_abs=max_abs,
                    num_nan=nan,
                    num_posinf=posinf,
                    num_neginf=neginf,
                    fingerprint=tuple(values[ends[i] - int(self.lengths[i]) : ends[i]]),
                )
            )
        return found

    def rows(self, width: int) -> np.ndarray:
        """[m, 3 + width]: the sums, then the fingerprint cut or padded with zeros to `width`."""
        out = np.zeros((self.owner.size, 3 + width), dtype=np.float64)
        out[:, :3] = self.sums
        if (self.lengths == width).all():
            out[:, 3:] = self.fingerprints.reshape(self.owner.size, width)
        else:
            for i, (start, length) in enumerate(
                zip(_starts(self.lengths).tolist(), self.lengths.tolist(), strict=True)
            ):
                kept = min(length, width)
                out[i, 3 : 3 + kept] = self.fingerprints[start : start + kept]
        return out


_COUNTS = ("num_nan", "num_posinf", "num_neginf")
_DTYPE_CODES = {name: i for i, name in enumerate(FLOAT_DTYPES)}
_READ = ", ".join(FLOAT_DTYPES)


class _Regions:
    """The pieces' region lists as one table of regions (each a flat range or a box, laid out as
    format 1.1 lays out a piece's), checked inside their parameters by `region_extents`."""

    def __init__(
        self, faults: _Faults, lists: list[Any], param: np.ndarray, params: Sequence[ParamInfo]
    ) -> None:
        n = len(lists)
        self.per_piece = np.fromiter(map(len, lists), dtype=np.int64, count=n)
        faults.flag(self.per_piece > MAX_LIST, ".regions", _too_many(self.per_piece, MAX_LIST))
        self.region_of = _starts(self.per_piece)  # each piece's first region
        owner = np.repeat(np.arange(n, dtype=np.int64), self.per_piece)

        def named(j: int) -> str:
            return f".regions[{j - int(self.region_of[owner[j]])}]"

        raws = faults.typed(list(itertools.chain.from_iterable(lists)), _DICT, named, owner)
        kinds, values = _spans(raws)
        self.kind = np.array(kinds, dtype=np.int64)  # -1: a flat range, k: a k-D box
        neither = self.kind == -2
        faults.flag(neither, lambda j: named(j) + _neither(raws[j])[0], lambda j: _neither(raws[j])[1], owner)
        self.kind[neither] = -1
        self.widths = np.where(self.kind < 0, 2, 2 * self.kind)
        self.first = _starts(self.widths)

        def coordinate(c: int) -> str:
            j, k = _segment(self.first, c)
            ndim = int(self.kind[j])
            part = (
                f"range[{k}]" if ndim < 0 else f"box.offsets[{k}]" if k < ndim else f"box.shape[{k - ndim}]"
            )
            return f"{named(j)}.{part}"

        self.coords = faults.ints(values, coordinate, np.repeat(owner, self.widths))[0]
        extents = _Extents(param[owner], self.first, np.maximum(self.kind, 0), self.kind < 0, params)
        outside, numel = region_extents(extents, self.coords, params)

        def lies_outside(j: int) -> tuple[str, str]:
            ndim, at, info = int(self.kind[j]), int(self.first[j]), params[int(param[owner[j]])]
            c = self.coords[at : at + int(self.widths[j])].tolist()
            if ndim < 0 and c[1] < c[0]:
                return ".range", f"stop {c[1]} is before start {c[0]}"
            text = f"flat range [{c[0]}, {c[1]})" if ndim < 0 else f"box offsets {c[:ndim]} shape {c[ndim:]}"
            return "", f"{text} lies outside parameter {shown(info.name)} of shape {list(info.global_shape)}"

        faults.flag(outside, lambda j: named(j) + lies_outside(j)[0], lambda j: lies_outside(j)[1], owner)
        self.single = self.per_piece == 1
        self.covered = np.zeros(n, dtype=np.int64)
        """Elements of each piece's regions (at most 2^53 + 1)."""
        self.covered[self.single] = numel[self.region_of[self.single]]
        numel_list = numel.tolist()
        for p in np.flatnonzero(~self.single).tolist():
            at = int(self.region_of[p])
            self.covered[p] = min(sum(numel_list[at : at + int(self.per_piece[p])]), MAX_ELEMENTS + 1)
        self.piece_kind = np.zeros(n, dtype=np.int64)
        self.piece_kind[self.single] = self.kind[self.region_of[self.single]]
        self.regular = self.single & (self.piece_kind != 0)
        """Pieces of one flat range or one box of at least one dimension: a row of the columns."""

    def fill(self, columns: PieceColumnsBuilder) -> None:
        """The builder's region columns; the other pieces' coordinates are (0, 0), their regions extras."""
        regular, first, widths, region_of = self.regular, self.first, self.widths, self.region_of
        columns.ndim = np.maximum(self.piece_kind, 0) * regular
        if regular.all():
            columns.coords, columns.first = self.coords, first
            return
        source, kept = np.full(regular.size, self.coords.size), np.full(regular.size, 2)
        source[regular], kept[regular] = first[region_of[regular]], widths[region_of[regular]]
        columns.coords = np.concatenate((self.coords, [0, 0]))[_gather(source, kept)]
        columns.first = _starts(kept)
        listed = self.coords.tolist()
        for p in np.flatnonzero(~regular).tolist():
            at = int(region_of[p])
            columns.extra["regions"][p] = tuple(
                _region(int(self.kind[j]), listed[int(first[j]) : int(first[j] + widths[j])])
                for j in range(at, at + int(self.per_piece[p]))
            )

    def other_shapes(
        self, shapes: list[list[int]], lengths: np.ndarray, dims: np.ndarray
    ) -> dict[int, tuple[int, ...]]:
        """Position -> local shape, where it is not the one its regions imply (a box's shape, else
        the element count), as `PieceColumnsBuilder.add` keeps them."""
        is_box = self.regular & (self.piece_kind > 0)
        differs = np.where(is_box, lengths != self.piece_kind, lengths != 1)
        same = np.flatnonzero(is_box & ~differs)
        if same.size:
            k = lengths[same]
            shape_at = _gather(self.first[self.region_of[same]] + k, k)
            unequal = dims[_gather(_starts(lengths)[same], k)] != self.coords[shape_at]
            differs[np.repeat(same, k)[unequal]] = True
        return {p: tuple(shapes[p]) for p in np.flatnonzero(differs).tolist()}


def _local_shapes(
    faults: _Faults, shapes: list[Any], covered: np.ndarray
) -> tuple[list[Any], np.ndarray, np.ndarray]:
    """(shapes, their lengths, their dimensions one after the other), each checked as a shape and
    against the elements its piece's regions cover."""
    n = len(shapes)
    lengths = np.fromiter(map(len, shapes), dtype=np.int64, count=n)
    faults.flag(
        lengths > MAX_DIMS, ".local_shape", lambda p: f"expected {_SHAPE[2]}, got {lengths[p]} entries"
    )
    starts = _starts(lengths)
    dims, plain = faults.ints(
        list(itertools.chain.from_iterable(shapes)),
        lambda d: ".local_shape[{1}]".format(*_segment(starts, d)),
        np.repeat(np.arange(n), lengths),
    )
    if not plain:
        listed = dims.tolist()
        shapes = [listed[a : a + b] for a, b in zip(starts.tolist(), lengths.tolist(), strict=True)]
    sizes = claimed = list(map(math.prod, shapes))
    if sizes and max(sizes) > MAX_ELEMENTS:
        faults.flag(
            np.array([s > MAX_ELEMENTS for s in sizes], dtype=bool),
            ".local_shape",
            lambda p: f"claims {claimed[p]} elements, more than any real tensor",
        )
        sizes = [min(s, MAX_ELEMENTS + 1) for s in sizes]
    faults.flag(
        np.array(sizes, dtype=np.int64) != covered,
        ".regions",
        lambda p: f"cover {covered[p]} elements but local_shape {list(shapes[p])} has {claimed[p]}",
    )
    return shapes, lengths, dims


def pieces_from_json(
    entries: list[Any], params: Sequence[ParamInfo], fail: Callable[[str, str], DumpFormatError]
) -> ColumnarPieces:
    """A format-1.0 document's pieces as columns. One pass per field collects its values into a
    column (checking types only where a value could not go in one), then the checks run on whole
    columns, those of format 1.1's (`region_extents`, `_more_than`) among them. The first bad
    piece, by position, is refused: `fail(field, problem)` names its field (`pieces[3].regions[0]`)
    and says what the first check to flag it found."""
    n = len(entries)
    faults = _Faults(n)
    if n and not params:
        raise fail("pieces", f"has {n} entries but the params list is empty")
    objs = faults.typed(entries, _DICT, "")

    def field(key: str, default: Any = _ABSENT) -> list[Any]:
        return [o.get(key, default) for o in objs]

    index_of = {p.name: i for i, p in enumerate(params)}
    names = faults.typed(field("param"), _STR, ".param")
    param = np.array([index_of.get(name, -1) for name in names], dtype=np.int64)
    faults.flag(param < 0, ".param", lambda p: f"names {shown(names[p])}, which is not in the params list")
    param[param < 0] = 0
    regions = _Regions(faults, faults.typed(field("regions"), _LIST, ".regions"), param, params)
    shapes = _local_shapes(
        faults, faults.typed(field("local_shape"), _SHAPE, ".local_shape"), regions.covered
    )
    tensors = _by_kind(faults, faults.typed(field("tensors", {}), _DICT, ".tensors"), ".tensors")
    for kind, keys in tensors.items():
        owner = np.fromiter(keys, dtype=np.int64, count=len(keys))
        faults.typed(list(keys.values()), _STR, f".tensors.{kind}", owner)
    stats_maps = faults.typed(field("stats", {}), _DICT, ".stats")
    stats: dict[TensorKind, _StatsColumns] = {}
    for kind, rows in _by_kind(faults, stats_maps, ".stats").items():
        owner = np.fromiter(rows, np.int64, len(rows))
        stats[kind] = _StatsColumns(faults, list(rows.values()), owner, regions.covered, f".stats.{kind}")
    call_lists = faults.typed(field("call_stats", []), _LIST, ".call_stats")
    calls_per_piece = np.fromiter(map(len, call_lists), dtype=np.int64, count=n)
    faults.flag(calls_per_piece > MAX_CLIP_CALLS, ".call_stats", _too_many(calls_per_piece, MAX_CLIP_CALLS))
    owner, all_calls = np.repeat(np.arange(n), calls_per_piece), list(itertools.chain(*call_lists))
    number = np.arange(owner.size) - _starts(calls_per_piece)[owner]  # of each call in its piece
    calls = _StatsColumns(faults, all_calls, owner, regions.covered, lambda i: f".call_stats[{number[i]}]")
    dtypes = faults.typed(field("dtype"), _STR, ".dtype")
    dtype_code = np.array([_DTYPE_CODES.get(d, -1) for d in dtypes], dtype=np.int64)
    faults.flag(
        dtype_code < 0,
        ".dtype",
        lambda p: f"{shown(dtypes[p], 40)} is not a floating dtype gradaudit reads ({_READ})",
    )
    local_names, groups, partials = (
        faults.typed(field(key, None), _OPTIONAL_STR, f".{key}")
        for key in ("local_name", "replica_group", "partial_group")
    )
    if faults.first < n:
        raise faults.error(fail)

    columns = PieceColumnsBuilder(params)
    columns.param, columns.groups, columns.tensors, extra = param, groups, tensors, columns.extra
    regions.fill(columns)
    extra["local_shapes"] = regions.other_shapes(*shapes)
    param_codes = np.array([_DTYPE_CODES.get(info.dtype, -1) for info in params], dtype=np.int64)
    extra["dtypes"] = {p: dtypes[p] for p in np.flatnonzero(dtype_code != param_codes[param]).tolist()}
    extra["local_names"] = {p: v for p, v in enumerate(local_names) if v is not None}
    extra["partial_groups"] = {p: v for p, v in enumerate(partials) if v is not None}
    objects, ends = calls.objects(range(calls.owner.size)), np.cumsum(calls_per_piece).tolist()
    extra["call_stats"] = {
        p: tuple(objects[ends[p] - int(calls_per_piece[p]) : ends[p]])
        for p in np.flatnonzero(calls_per_piece).tolist()
    }
    with_stats = next((p for p, m in enumerate(stats_maps) if m), None)
    if with_stats is not None:  # the norm type of the first statistics, as `add` takes it
        columns.norm_type = float(stats[next(iter(stats_maps[with_stats]))].norm_type[0])
    for kind, table in stats.items():
        width = int(table.lengths[0])
        columns.stats[kind] = (width, table.owner, table.rows(width), table.counts)
        odd = np.flatnonzero((table.norm_type != columns.norm_type) | (table.lengths != width)).tolist()
        for i, summary in zip(odd, table.objects(odd), strict=True):
            columns.odd[(int(table.owner[i]), kind)] = summary
    return columns.result()


def _region(kind: int, coords: list[int]) -> Region:
    if kind < 0:
        return FlatRange(start=coords[0], stop=coords[1])
    return Box(offsets=tuple(coords[:kind]), shape=tuple(coords[kind:]))


_KINDS = frozenset(TENSOR_KINDS)


def _by_kind(faults: _Faults, maps: list[dict[str, Any]], where: str) -> dict[TensorKind, dict[int, Any]]:
    """Kind -> position -> entry, of the pieces' objects keyed by tensor kind (the kinds in the order
    they first appear); a piece naming another kind is flagged."""
    kinds = dict.fromkeys(itertools.chain.from_iterable(maps))
    if not _KINDS.issuperset(kinds):

        def unknown(p: int) -> str:
            kind = next(k for k in maps[p] if k not in _KINDS)
            return f"unknown tensor kind {shown(kind, 40)} (known: {', '.join(TENSOR_KINDS)})"

        faults.flag(np.array([not _KINDS.issuperset(m) for m in maps], dtype=bool), where, unknown)
    return {kind: {p: m[kind] for p, m in enumerate(maps) if kind in m} for kind in kinds if kind in _KINDS}
