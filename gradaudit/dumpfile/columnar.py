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
as columns (model.ColumnarPieces, the one form of every rank's pieces): a Piece object is built
only when one is indexed or iterated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import DumpFormatError
from ..model import FLOAT_DTYPES, TENSOR_KINDS, ColumnarPieces, ParamInfo, RankDump, TensorKind, Topology

__all__ = ["ColumnarPieces", "ParamIds", "columns_of", "from_columns", "pieces_from_rows", "to_columns"]

PREFIX = "__gradaudit__."
PIECES, COORDS = PREFIX + "pieces", PREFIX + "coords"
NAMES, META, DIMS = PREFIX + "params.names", PREFIX + "params.meta", PREFIX + "params.dims"
MAX_FINGERPRINT = 64
MAX_DIMS = 64
MAX_ELEMENTS = 2**53

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


def params_to_columns(params: Sequence[ParamInfo]) -> dict[str, np.ndarray] | None:
    if not params or any(p.dtype not in FLOAT_DTYPES for p in params):
        return None
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
    """(the "columnar" descriptor, the arrays by key) of `dump`'s pieces, or None when the columns
    would not hold them whole (tensors, several regions, a local name, a dtype other than its
    parameter's, differing norm types or fingerprint lengths: `ColumnarPieces.stats_only`)."""
    pieces = dump.columns
    return columns_of(pieces) if pieces.stats_only else None


def columns_of(pieces: ColumnarPieces) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the "columnar" descriptor, the arrays by key) of pieces held as columns, their parameter
    table included (inline columns; "json" when a dtype has no code)."""
    arrays: dict[str, np.ndarray] = {PIECES: pieces.rows, COORDS: pieces.coords}
    for kind in pieces.kinds:
        arrays[stats_key(kind)] = pieces.stats[kind]
        arrays[counts_key(kind)] = pieces.counts[kind]
    param_columns = params_to_columns(pieces.params)
    if param_columns is not None:
        arrays.update(param_columns)
    norm_type = pieces.norm_type
    descriptor = {
        "params": "columns" if param_columns is not None else "json",
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
    index_of = {info.name: i for i, info in enumerate(params)}
    group_names = sorted({g for g in groups if g is not None})
    group_index: dict[str | None, int] = {g: i for i, g in enumerate(group_names)}
    group_index[None] = -1
    ndim = np.array(ndims, dtype=np.int64)
    width = np.where(ndim == 0, 2, 2 * ndim)
    table = np.stack(
        [
            np.array([index_of[name] for name in param_names], dtype=np.int64),
            np.array([group_index[g] for g in groups], dtype=np.int64),
            np.concatenate(([0], np.cumsum(width)[:-1])).astype(np.int64),
            ndim,
        ],
        axis=1,
    )
    kinds = sorted(rows)
    return ColumnarPieces(
        table,
        np.array(coords, dtype=np.int64),
        params,
        group_names,
        {k: np.ascontiguousarray(rows[k][:, :-3]) for k in kinds},
        {k: rows[k][:, -3:].astype(np.int64) for k in kinds},
        float(norm_type),
    )


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
        extents = _Extents(rows, params)
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
    """What the extent checks read of a valid piece table: the flat pieces, where their ranges
    start in the coordinates, their parameters' element counts, and the boxes."""

    def __init__(self, rows: np.ndarray, params: Sequence[ParamInfo]) -> None:
        param, first, ndim = rows[:, 0], rows[:, 2], rows[:, 3]
        self.flat = np.flatnonzero(ndim == 0)
        self.all_flat = self.flat.size == ndim.size
        self.first = first[self.flat]
        self.limit = _param_columns(params)[1][param[self.flat]]
        self.boxes = np.flatnonzero(ndim != 0)


def _check_extents(
    extents: _Extents,
    rows: np.ndarray,
    coords: np.ndarray,
    params: Sequence[ParamInfo],
    counts: Mapping[str, np.ndarray],
    fail: Fail,
) -> None:
    """Ranges and boxes inside their parameter and nonfinite counts within each piece's elements,
    for all pieces at once."""
    flat = extents.flat
    start, stop = coords[extents.first], coords[extents.first + 1]
    bad = (start < 0) | (start > stop) | (stop > extents.limit)
    if bad.any():
        i = int(flat[np.argmax(bad)])
        at, param = int(rows[i, 2]), int(rows[i, 0])
        raise fail(f"piece {i}: range [{coords[at]}, {coords[at + 1]}) is outside {params[param].name!r:.60}")
    numel = stop - start
    for kind, counted in counts.items():
        if not counted.any():
            continue
        over = _more_than(counted if extents.all_flat else counted[flat], numel)
        if over.any():
            raise fail(f"piece {int(flat[np.argmax(over)])}: more nonfinite {kind} values than elements")
    if extents.boxes.size:
        _check_boxes(extents.boxes, rows, coords, params, counts, fail)


def _check_boxes(
    boxes: np.ndarray,
    rows: np.ndarray,
    coords: np.ndarray,
    params: Sequence[ParamInfo],
    counts: Mapping[str, np.ndarray],
    fail: Fail,
) -> None:
    """Boxes inside their parameter and nonfinite counts within their elements; the first bad box
    (by position) is named, outside before too many nonfinite values."""
    outside = np.zeros(boxes.size, dtype=bool)
    too_many = np.zeros(boxes.size, dtype=bool)
    param, first, ndim = rows[boxes, 0], rows[boxes, 2], rows[boxes, 3]
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
        out = ((offsets < 0) | (shape < 0) | (offsets > dims) | (shape > dims - offsets)).any(axis=1)
        outside[chosen] = out
        # Inside its parameter, a box's product is at most the parameter's (2^53): no wrap-around.
        numel = np.prod(np.where(out[:, None], 0, shape), axis=1, dtype=np.int64)
        for counted in counts.values():
            too_many[chosen] |= _more_than(counted[boxes[chosen]], numel)
    bad = outside | too_many
    if bad.any():
        j = int(np.argmax(bad))
        i = int(boxes[j])
        if outside[j]:
            k, at, info = int(rows[i, 3]), int(rows[i, 2]), params[int(rows[i, 0])]
            offsets, shape = coords[at : at + k].tolist(), coords[at + k : at + 2 * k].tolist()
            raise fail(f"piece {i}: box {offsets} + {shape} is outside {info.name!r:.60}")
        raise fail(f"piece {i}: more nonfinite values than elements")


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
