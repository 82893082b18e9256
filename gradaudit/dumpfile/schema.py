"""Dump format v1: the JSON metadata stored in each safetensors header, both directions.

The writer calls `encode_rank`, the loader calls `decode_rank`; neither knows about files.
Every check of untrusted input raises DumpFormatError naming the file and the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..errors import DumpFormatError, clipped, shown
from ..model import (
    FLOAT_DTYPES,
    MODES,
    Box,
    ClipCall,
    ClipRecord,
    DataRecord,
    MeshInfo,
    NotCapturedParam,
    ParamInfo,
    Piece,
    Region,
    TensorStats,
    Topology,
)
from ..version import FORMAT_MAJOR, FORMAT_NAME, FORMAT_VERSION
from .columnar import (
    MAX_CLIP_CALLS,
    MAX_ELEMENTS,
    MAX_LIST,
    ParamsCache,
    from_columns,
    kind_of,
    params_from_columns,
    pieces_from_json,
)
from .columnar import MAX_INT as MAX_INT  # capture/arguments.py checks counters against it
from .dump import RankDump

METADATA_KEY = "gradaudit"
"""The key of the safetensors `__metadata__` entry that holds our JSON document."""

MAX_WORLD_SIZE = 1 << 20
"""Larger than any job that exists; the loader lists missing ranks, so this bounds that list."""

_T = TypeVar("_T")
_D = TypeVar("_D")

_VERSION = re.compile(r"([0-9]{1,9})(?:\.[0-9]{1,9}){0,2}")


# ---------------------------------------------------------------- encoding


def encode_float(value: float | None) -> float | str | None:
    """JSON has no nan/inf: those become the strings "nan", "inf", "-inf"."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _encode_region(region: Region) -> dict[str, Any]:
    if isinstance(region, Box):
        return {"box": {"offsets": list(region.offsets), "shape": list(region.shape)}}
    return {"range": [region.start, region.stop]}


def _encode_stats(stats: TensorStats) -> dict[str, Any]:
    return {
        "numel": stats.numel,
        "norm_type": encode_float(stats.norm_type),
        "sum_pow": encode_float(stats.sum_pow),
        "sum_sq": encode_float(stats.sum_sq),
        "max_abs": encode_float(stats.max_abs),
        "num_nan": stats.num_nan,
        "num_posinf": stats.num_posinf,
        "num_neginf": stats.num_neginf,
        "fingerprint": [encode_float(v) for v in stats.fingerprint],
    }


def _encode_piece(piece: Piece) -> dict[str, Any]:
    out: dict[str, Any] = {
        "param": piece.param,
        "regions": [_encode_region(r) for r in piece.regions],
        "local_shape": list(piece.local_shape),
        "dtype": piece.dtype,
    }
    if piece.local_name is not None:
        out["local_name"] = piece.local_name
    if piece.replica_group is not None:
        out["replica_group"] = piece.replica_group
    if piece.tensors:
        out["tensors"] = dict(sorted(piece.tensors.items()))
    if piece.stats:
        out["stats"] = {k: _encode_stats(v) for k, v in sorted(piece.stats.items())}
    if piece.call_stats:
        out["call_stats"] = [_encode_stats(v) for v in piece.call_stats]
    if piece.partial_group is not None:
        out["partial_group"] = piece.partial_group
    return out


_CALL_FLOATS = ("reported_norm", "reported_local_norm", "max_norm", "norm_type", "loss_scale", "clip_value")
"""The optional numbers of a clip call (`ClipCall`); "clip_value" is written only when set."""
_CLIP_FLOATS = ("reported_norm", "clip_coef", "loss_scale")
_CLIP_FLAGS = ("unscaled_before_clip", "found_inf", "step_skipped")
"""The optional numbers and flags of a clip record (`ClipRecord`) besides max_norm and norm_type."""


def _encode_clip(clip: ClipRecord) -> dict[str, Any]:
    return {
        "max_norm": encode_float(clip.max_norm),
        "norm_type": encode_float(clip.norm_type),
        "calls": [
            {"unscaled": c.unscaled}
            | {
                key: encode_float(getattr(c, key))
                for key in _CALL_FLOATS
                if key != "clip_value" or c.clip_value is not None
            }
            for c in clip.calls
        ],
        **{key: encode_float(getattr(clip, key)) for key in _CLIP_FLOATS},
        **{key: getattr(clip, key) for key in _CLIP_FLAGS},
    }


_NOTES = ("capture_api", "trigger", "trigger_note")
"""Optional strings of a rank file, written only when set (so that other files keep their bytes)."""


def encode_rank(dump: RankDump) -> dict[str, Any]:
    """The JSON document for one rank's file (the `path` and `num_bytes` fields are not stored)."""
    topo = dump.topology
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": dump.step,
        "rank": dump.rank,
        "world_size": dump.world_size,
        "mode": dump.mode,
        "run_id": dump.run_id,
        **{key: getattr(dump, key) for key in _NOTES if getattr(dump, key) is not None},
        "host": dump.host,
        "torch_version": dump.torch_version,
        "gradaudit_version": dump.gradaudit_version,
        "created_at": dump.created_at,
        "params": [
            {"name": p.name, "global_shape": list(p.global_shape), "dtype": p.dtype} for p in dump.params
        ],
        "pieces": [_encode_piece(p) for p in dump.pieces],
        "aliases": dict(sorted(dump.aliases.items())),
        "topology": {
            "groups": {name: [list(g) for g in groups] for name, groups in sorted(topo.groups.items())},
            "mesh": None
            if topo.mesh is None
            else {
                "shape": list(topo.mesh.shape),
                "axis_names": list(topo.mesh.axis_names),
                "ranks": list(topo.mesh.ranks),
            },
            "norm_group": topo.norm_group,
        },
        "clip": None if dump.clip is None else _encode_clip(dump.clip),
        "data": {
            "tokens": dump.data.tokens,
            "loss": encode_float(dump.data.loss),
            "loss_reduction": dump.data.loss_reduction,
        },
    } | _encode_not_captured(dump.not_captured)


def _encode_not_captured(params: tuple[NotCapturedParam, ...]) -> dict[str, Any]:
    """Only when some parameter was left out, so that other files keep their bytes."""
    if not params:
        return {}
    return {"not_captured": [{"name": p.name, "reason": p.reason} for p in params]}


# ---------------------------------------------------------------- decoding


class _Reader:
    """Typed access to untrusted JSON; every failure names the file and the field path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> DumpFormatError:
        return DumpFormatError(
            self.path,
            f"metadata field {clipped(where, 160)}: {problem}",
            "the file is not a valid gradaudit dump",
        )

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected an object, got {kind_of(value)}")
        return value

    def get(
        self,
        obj: Mapping[str, Any],
        key: str,
        where: str,
        conv: Callable[[Any, str], _T],
        *,
        default: _T | None = None,
    ) -> _T:
        """`conv` of the field, or `default` when it is missing (DumpFormatError without a default)."""
        if key not in obj:
            if default is None:
                raise self.fail(f"{where}.{key}" if where else key, "missing")
            return default
        return conv(obj[key], f"{where}.{key}" if where else key)

    def opt(self, obj: Mapping[str, Any], key: str, where: str, conv: Callable[[Any, str], _T]) -> _T | None:
        """`conv` of the field, or None when it is missing or null."""
        return None if obj.get(key) is None else self.get(obj, key, where, conv)

    def int_(self, value: Any, where: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(where, f"expected an integer, got {kind_of(value)}")
        if value < minimum:
            raise self.fail(where, f"must be >= {minimum}, got {clipped(str(value), 40)}")
        if value > maximum:
            raise self.fail(where, f"must be <= {maximum}, got {clipped(str(value), 40)}")
        return value

    def str_(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(where, f"expected a string, got {kind_of(value)}")
        return value

    def bool_(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, f"expected true or false, got {kind_of(value)}")
        return value

    def float_(self, value: Any, where: str) -> float:
        """A number, or one of the strings "nan", "inf", "-inf"."""
        if isinstance(value, str) and value in ("nan", "inf", "-inf"):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(where, f"expected a number, got {kind_of(value)}")
        try:
            return float(value)
        except OverflowError:
            raise self.fail(where, "is a number too large for a float64") from None

    def pos_float(self, value: Any, where: str) -> float:
        number = self.float_(value, where)
        if not (number > 0):
            raise self.fail(where, f"must be a positive number, got {shown(value, 40)}")
        return number

    def shape(self, value: Any, where: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > 64:
            raise self.fail(where, "expected a list of at most 64 integers")
        dims = tuple(self.int_(v, f"{where}[{i}]") for i, v in enumerate(value))
        if math.prod(dims) > MAX_ELEMENTS:
            raise self.fail(where, f"claims {math.prod(dims)} elements, more than any real tensor")
        return dims

    def list_(self, value: Any, where: str, limit: int = MAX_LIST) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"expected a list, got {kind_of(value)}")
        if len(value) > limit:
            raise self.fail(where, f"has {len(value)} entries, more than {limit}")
        return value

    def dtype(self, value: Any, where: str) -> str:
        name = self.str_(value, where)
        if name not in FLOAT_DTYPES:
            raise self.fail(
                where,
                f"{shown(name, 40)} is not a floating dtype gradaudit reads ({', '.join(FLOAT_DTYPES)})",
            )
        return name


_KNOWN_DTYPES = frozenset(FLOAT_DTYPES)


def _quick_dims(value: Any) -> tuple[int, ...] | None:
    """`_Reader.shape` for a well-formed list; None for anything it would have to look at closely."""
    if type(value) is not list or len(value) > 64:
        return None
    for v in value:
        if type(v) is not int or v < 0 or v > MAX_INT:
            return None
    dims = tuple(value)
    return dims if math.prod(dims) <= MAX_ELEMENTS else None


def _quick_param(raw: Any) -> ParamInfo | None:
    """A `params` entry decoded when well formed, else None (the careful decoder then names the defect)."""
    if type(raw) is not dict:
        return None
    name, dtype = raw.get("name"), raw.get("dtype")
    global_shape = _quick_dims(raw.get("global_shape"))
    if type(name) is not str or global_shape is None or type(dtype) is not str or dtype not in _KNOWN_DTYPES:
        return None
    return ParamInfo(name=name, global_shape=global_shape, dtype=dtype)


def _plain_ranks(values: Any, world_size: int, limit: int) -> tuple[int, ...] | None:
    """`values` as a tuple when it is a non-empty list of at most `limit` ints in [0, world_size),
    checked at C speed: every rank's file lists the groups of every rank, so checking them one value
    at a time grew with the square of the world size. None sends the list to the checks that name
    the bad entry."""
    if (
        isinstance(values, list)
        and 0 < len(values) <= limit
        and set(map(type, values)) == {int}
        and min(values) >= 0
        and max(values) < world_size
    ):
        return tuple(values)
    return None


def _decode_groups(
    r: _Reader, raw: Any, where: str, world_size: int
) -> dict[str, tuple[tuple[int, ...], ...]]:
    groups = {}
    for name, lists in r.obj(raw, where).items():
        rank_lists = []
        for i, ranks in enumerate(r.list_(lists, f"{where}.{name}", limit=1_000_000)):
            plain = _plain_ranks(ranks, world_size, 1_000_000)
            if plain is not None:
                rank_lists.append(plain)
                continue
            members = tuple(
                r.int_(v, f"{where}.{name}[{i}][{j}]")
                for j, v in enumerate(r.list_(ranks, f"{where}.{name}[{i}]", limit=1_000_000))
            )
            if any(m >= world_size for m in members):
                raise r.fail(f"{where}.{name}[{i}]", f"names a rank outside world size {world_size}")
            rank_lists.append(members)
        groups[name] = tuple(rank_lists)
    return groups


def _decode_topology(r: _Reader, raw: Any, world_size: int) -> Topology:
    obj = r.obj(raw, "topology")
    mesh = None
    mesh_raw = obj.get("mesh")
    if mesh_raw is not None:
        m = r.obj(mesh_raw, "topology.mesh")
        shape = r.get(m, "shape", "topology.mesh", r.shape)
        names = tuple(
            r.str_(v, f"topology.mesh.axis_names[{i}]")
            for i, v in enumerate(r.get(m, "axis_names", "topology.mesh", r.list_))
        )
        ranks = _plain_ranks(m.get("ranks"), world_size, MAX_LIST) or tuple(
            r.int_(v, f"topology.mesh.ranks[{i}]", maximum=world_size - 1)
            for i, v in enumerate(r.get(m, "ranks", "topology.mesh", r.list_))
        )
        if len(shape) != len(names) or math.prod(shape) != len(ranks):
            raise r.fail(
                "topology.mesh",
                f"shape {list(shape)}, {len(names)} axis names and {len(ranks)} ranks disagree",
            )
        mesh = MeshInfo(shape=shape, axis_names=names, ranks=ranks)
    return Topology(
        groups=_decode_groups(r, obj.get("groups", {}), "topology.groups", world_size),
        mesh=mesh,
        norm_group=r.opt(obj, "norm_group", "topology", r.str_),
    )


def _decode_clip(r: _Reader, raw: Any) -> ClipRecord | None:
    if raw is None:
        return None
    obj = r.obj(raw, "clip")
    calls = []
    calls_raw: list[Any] = r.get(
        obj, "calls", "clip", lambda v, w: r.list_(v, w, limit=MAX_CLIP_CALLS), default=[]
    )
    for i, call_raw in enumerate(calls_raw):
        where = f"clip.calls[{i}]"
        call = r.obj(call_raw, where)
        floats = {key: r.opt(call, key, where, r.float_) for key in _CALL_FLOATS}
        calls.append(ClipCall(unscaled=r.opt(call, "unscaled", where, r.bool_), **floats))
    max_norm = r.get(obj, "max_norm", "clip", r.pos_float)
    if not math.isfinite(max_norm):
        raise r.fail("clip.max_norm", "must be finite")
    norm_type = r.get(obj, "norm_type", "clip", r.pos_float, default=2.0)
    fields: dict[str, Any] = {key: r.opt(obj, key, "clip", r.float_) for key in _CLIP_FLOATS}
    fields |= {key: r.opt(obj, key, "clip", r.bool_) for key in _CLIP_FLAGS}
    return ClipRecord(max_norm=max_norm, norm_type=norm_type, calls=tuple(calls), **fields)


def check_format_version(doc: Mapping[str, Any], path: str) -> None:
    """Refuse documents that are not ours, or from a newer major version; accept newer minors."""
    if doc.get("format") != FORMAT_NAME:
        raise DumpFormatError(
            path, "is not a gradaudit dump (no gradaudit format marker)", "was it written by gradaudit.dump?"
        )
    version = doc.get("format_version")
    match = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise DumpFormatError(
            path, f"has an unreadable format_version {shown(version, 40)}", "expected MAJOR.MINOR"
        )
    major = int(match.group(1))
    if major > FORMAT_MAJOR:
        raise DumpFormatError(
            path,
            f"uses dump format {version}, newer than the {FORMAT_VERSION} this gradaudit reads",
            "upgrade gradaudit: pip install -U gradaudit",
        )
    if major < 1:
        raise DumpFormatError(path, f"uses unknown dump format {version}")


def decode_rank(
    doc: Any,
    path: str,
    *,
    num_bytes: int = 0,
    arrays: Mapping[str, Any] | None = None,
    params_cache: ParamsCache | None = None,
) -> RankDump:
    """Validate and convert one file's JSON document; unknown keys are ignored. `arrays` holds the
    file's format-1.1 columns (numpy arrays by tensor key) when its document has a "columnar" entry."""
    r = _Reader(path)
    doc = r.obj(doc, "(root)")
    check_format_version(doc, path)
    world_size = r.get(doc, "world_size", "", lambda v, w: r.int_(v, w, minimum=1, maximum=MAX_WORLD_SIZE))
    rank = r.get(doc, "rank", "", r.int_)
    if rank >= world_size:
        raise r.fail("rank", f"rank {rank} is outside world size {world_size}")
    params: dict[str, ParamInfo] = {}
    table: tuple[ParamInfo, ...] | None = None  # as columns: the very tuple every rank shares
    columnar = doc.get("columnar")
    if isinstance(columnar, dict) and columnar.get("params") == "columns":
        if r.get(doc, "params", "", r.list_):
            raise r.fail("params", "must be empty when the parameters are stored as columns")
        table = params_from_columns(arrays or {}, path, params_cache)
    for i, raw in enumerate(r.get(doc, "params", "", r.list_)):
        info = _quick_param(raw)
        if info is None:
            where = f"params[{i}]"
            obj = r.obj(raw, where)
            info = ParamInfo(
                name=r.get(obj, "name", where, r.str_),
                global_shape=r.get(obj, "global_shape", where, r.shape),
                dtype=r.get(obj, "dtype", where, r.dtype),
            )
        if info.name in params:
            raise r.fail(f"params[{i}]", f"parameter {shown(info.name)} is listed twice")
        params[info.name] = info
    table = tuple(params.values()) if table is None else table
    if "columnar" in doc:
        if r.get(doc, "pieces", "", r.list_):
            raise r.fail("pieces", "must be empty when the pieces are stored as columns")
        pieces = from_columns(doc["columnar"], arrays or {}, table, path, params_cache)
    else:  # format 1.0: collected into columns, checked as columns, the first bad piece named
        pieces = pieces_from_json(r.get(doc, "pieces", "", r.list_), table, r.fail)
    raw_aliases: dict[str, Any] = r.get(doc, "aliases", "", r.obj, default={})
    aliases = {r.str_(k, "aliases"): r.str_(v, f"aliases.{k}") for k, v in raw_aliases.items()}
    data: dict[str, Any] = r.get(doc, "data", "", r.obj, default={})
    mode = r.get(doc, "mode", "", r.str_, default="full")
    if mode not in MODES:
        raise r.fail("mode", f"must be 'full' or 'stats', got {shown(mode, 40)}")
    reduction = r.opt(data, "loss_reduction", "data", r.str_)
    if reduction not in (None, "mean", "sum"):
        raise r.fail("data.loss_reduction", f"must be 'mean' or 'sum', got {shown(reduction, 40)}")
    return RankDump(
        path=path,
        rank=rank,
        world_size=world_size,
        step=r.get(doc, "step", "", r.int_),
        mode=mode,
        run_id=r.opt(doc, "run_id", "", r.str_),
        host=r.get(doc, "host", "", r.str_, default=""),
        torch_version=r.get(doc, "torch_version", "", r.str_, default=""),
        gradaudit_version=r.get(doc, "gradaudit_version", "", r.str_, default=""),
        created_at=r.get(doc, "created_at", "", r.str_, default=""),
        params=table,
        pieces=pieces,
        aliases=aliases,
        topology=_topology_of(r, doc.get("topology", {}), world_size, params_cache),
        clip=_decode_clip(r, doc.get("clip")),
        data=DataRecord(
            tokens=r.opt(data, "tokens", "data", r.int_),
            loss=r.opt(data, "loss", "data", r.float_),
            loss_reduction=reduction,
        ),
        num_bytes=num_bytes,
        not_captured=_decode_not_captured(r, doc.get("not_captured")),
        capture_api=r.opt(doc, "capture_api", "", r.str_),
        trigger=r.opt(doc, "trigger", "", r.str_),
        trigger_note=r.opt(doc, "trigger_note", "", r.str_),
    )


def _topology_of(r: _Reader, raw: Any, world_size: int, cache: ParamsCache | None) -> Topology:
    """The decoded topology, the very one of the load's last rank when its entry is equal."""
    known = None if cache is None else cache.topology
    if known is not None and known[1] == world_size and known[0] == raw:
        return known[2]
    topology = _decode_topology(r, raw, world_size)
    if cache is not None:
        cache.topology = (raw, world_size, topology)
    return topology


def _decode_not_captured(r: _Reader, raw: Any) -> tuple[NotCapturedParam, ...]:
    if raw is None:
        return ()
    found = []
    for i, entry in enumerate(r.list_(raw, "not_captured", limit=1_000_000)):
        where = f"not_captured[{i}]"
        obj = r.obj(entry, where)
        found.append(
            NotCapturedParam(
                name=r.get(obj, "name", where, r.str_), reason=r.get(obj, "reason", where, r.str_)
            )
        )
    return tuple(found)
