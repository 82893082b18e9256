"""Format 1.0's column decoder (`columnar.pieces_from_json`: the pieces collected into columns, then
checked as columns) agrees with the careful per-piece decoder, the oracle here (the loader's own
until the column checks named the bad piece themselves).

For every document both give equal pieces, or both refuse it naming the same first bad piece and
field (the wording may differ); the quick parameter decoder never accepts an entry the careful one
refuses.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.dumpfile.columnar import MAX_CLIP_CALLS
from gradaudit.dumpfile.dump import PieceColumnsBuilder, PieceExtras, RankDump, as_columns
from gradaudit.dumpfile.header import parse_json
from gradaudit.dumpfile.schema import _quick_param, _Reader, decode_rank, encode_rank
from gradaudit.errors import DumpFormatError, shown
from gradaudit.model import TENSOR_KINDS, Box, ClipRecord, FlatRange, ParamInfo, Piece, Region, TensorStats

# ---------------------------------------------------------------- the oracle: the careful per-piece decoder


def _decode_region(r: _Reader, raw: Any, where: str) -> Region:
    obj = r.obj(raw, where)
    if "box" in obj:
        box = r.obj(obj["box"], f"{where}.box")
        offsets = r.get(box, "offsets", f"{where}.box", r.shape)
        shape = r.get(box, "shape", f"{where}.box", r.shape)
        if len(offsets) != len(shape):
            raise r.fail(f"{where}.box", f"offsets {list(offsets)} and shape {list(shape)} differ in length")
        return Box(offsets=offsets, shape=shape)
    if "range" in obj:
        bounds = r.list_(obj["range"], f"{where}.range", limit=2)
        if len(bounds) != 2:
            raise r.fail(f"{where}.range", "expected [start, stop]")
        start, stop = (r.int_(v, f"{where}.range[{i}]") for i, v in enumerate(bounds))
        if stop < start:
            raise r.fail(f"{where}.range", f"stop {stop} is before start {start}")
        return FlatRange(start=start, stop=stop)
    raise r.fail(where, 'expected a "box" or a "range"')


def _decode_stats(r: _Reader, raw: Any, where: str) -> TensorStats:
    obj = r.obj(raw, where)

    def nonneg(value: Any, where: str) -> float:
        number = r.float_(value, where)
        if not (number >= 0):
            raise r.fail(where, f"must be a non-negative number, got {shown(value, 40)}")
        return number

    def count(key: str) -> int:
        return r.get(obj, key, where, r.int_, default=0)

    stats = TensorStats(
        numel=r.get(obj, "numel", where, r.int_),
        norm_type=r.get(obj, "norm_type", where, r.pos_float),
        sum_pow=r.get(obj, "sum_pow", where, nonneg),
        sum_sq=r.get(obj, "sum_sq", where, nonneg),
        max_abs=r.get(obj, "max_abs", where, nonneg),
        num_nan=count("num_nan"),
        num_posinf=count("num_posinf"),
        num_neginf=count("num_neginf"),
        fingerprint=tuple(
            r.float_(v, f"{where}.fingerprint[{i}]")
            for i, v in enumerate(
                r.get(obj, "fingerprint", where, lambda v, w: r.list_(v, w, 64), default=[])
            )
        ),
    )
    if stats.num_nonfinite > stats.numel:
        raise r.fail(where, f"counts {stats.num_nonfinite} nonfinite values in {stats.numel} elements")
    return stats


def _decode_piece(
    r: _Reader, raw: Any, where: str, index: int, params: Mapping[str, ParamInfo]
) -> dict[str, Any]:
    """One format-1.0 piece, checked field by field, the first defect named: Piece's fields by name."""
    obj = r.obj(raw, where)
    name = r.get(obj, "param", where, r.str_)
    if name not in params:
        raise r.fail(f"{where}.param", f"names {shown(name)}, which is not in the params list")
    info = params[name]
    regions = tuple(
        _decode_region(r, reg, f"{where}.regions[{i}]")
        for i, reg in enumerate(r.get(obj, "regions", where, r.list_))
    )
    for i, region in enumerate(regions):
        if not region.fits_in(info.global_shape):
            raise r.fail(
                f"{where}.regions[{i}]",
                f"{_region_text(region)} lies outside parameter {shown(name)} of shape {list(info.global_shape)}",
            )
    local_shape = r.get(obj, "local_shape", where, r.shape)
    covered = sum(reg.numel for reg in regions)
    if covered != math.prod(local_shape):
        raise r.fail(
            f"{where}.regions",
            f"cover {covered} elements but local_shape {list(local_shape)} has {math.prod(local_shape)}",
        )
    tensors_raw = r.get(obj, "tensors", where, r.obj, default={})
    tensors = {}
    for kind, key in tensors_raw.items():
        if kind not in TENSOR_KINDS:
            raise r.fail(
                f"{where}.tensors",
                f"unknown tensor kind {shown(kind, 40)} (known: {', '.join(TENSOR_KINDS)})",
            )
        tensors[kind] = r.str_(key, f"{where}.tensors.{kind}")
    stats_raw = r.get(obj, "stats", where, r.obj, default={})
    stats = {}
    for kind, value in stats_raw.items():
        if kind not in TENSOR_KINDS:
            raise r.fail(
                f"{where}.stats", f"unknown tensor kind {shown(kind, 40)} (known: {', '.join(TENSOR_KINDS)})"
            )
        stats[kind] = _decode_stats(r, value, f"{where}.stats.{kind}")
        if stats[kind].numel != covered:
            raise r.fail(
                f"{where}.stats.{kind}.numel", f"is {stats[kind].numel} but the piece holds {covered}"
            )
    call_stats = tuple(
        _decode_stats(r, value, f"{where}.call_stats[{i}]")
        for i, value in enumerate(
            r.get(obj, "call_stats", where, lambda v, w: r.list_(v, w, MAX_CLIP_CALLS), default=[])
        )
    )
    for i, summary in enumerate(call_stats):
        if summary.numel != covered:
            raise r.fail(
                f"{where}.call_stats[{i}].numel", f"is {summary.numel} but the piece holds {covered}"
            )
    return {
        "index": index,
        "param": name,
        "regions": regions,
        "local_shape": local_shape,
        "dtype": r.get(obj, "dtype", where, r.dtype),
        "local_name": r.opt(obj, "local_name", where, r.str_),
        "replica_group": r.opt(obj, "replica_group", where, r.str_),
        "tensors": tensors,
        "stats": stats,
        "call_stats": call_stats,
        "partial_group": r.opt(obj, "partial_group", where, r.str_),
    }


def _region_text(region: Region) -> str:
    if isinstance(region, Box):
        return f"box offsets {list(region.offsets)} shape {list(region.shape)}"
    return f"flat range [{region.start}, {region.stop})"


PARAMS = (
    ParamInfo(name="w", global_shape=(4, 6), dtype="float32"),
    ParamInfo(name="b", global_shape=(6,), dtype="bfloat16"),
)


def _stats(numel: int, *, norm_type: float = 2.0, nan: int = 0) -> TensorStats:
    return TensorStats(
        numel=numel,
        norm_type=norm_type,
        sum_pow=0.5 if not math.isinf(norm_type) else 0.25,
        sum_sq=0.5,
        max_abs=0.25,
        num_nan=nan,
        fingerprint=(0.125, -3.5),
    )


def _pieces() -> tuple[Piece, ...]:
    return (
        Piece(
            index=0,
            param="w",
            regions=(Box(offsets=(0, 0), shape=(2, 6)),),
            local_shape=(2, 6),
            dtype="float32",
            tensors={"grad": "w.grad", "grad_clipped": "w.grad_clipped"},
        ),
        Piece(
            index=1,
            param="w",
            regions=(FlatRange(start=12, stop=18), FlatRange(start=20, stop=24)),
            local_shape=(10,),
            dtype="float32",
            local_name="tied.w",
            replica_group="dp",
            stats={"grad": _stats(10), "grad_clipped": _stats(10, nan=2)},
        ),
        Piece(
            index=2,
            param="b",
            regions=(FlatRange(start=0, stop=6),),
            local_shape=(6,),
            dtype="bfloat16",
            tensors={"param_after": "b.after"},
            stats={"grad": _stats(6, norm_type=math.inf)},
        ),
    )


def _document() -> dict:
    dump = RankDump(
        path="rank_00000.safetensors",
        rank=0,
        world_size=2,
        step=3,
        mode="stats",
        params=PARAMS,
        pieces=as_columns(PARAMS, _pieces()),
        clip=ClipRecord(max_norm=1.0),
    )
    return parse_json(json.dumps(encode_rank(dump)))  # exactly what the loader sees


def form(pieces) -> object:
    """Pieces as columns in a form that compares NaN equal to NaN (a fingerprint may hold one) and
    mappings whatever their order, or an error message as is."""
    if isinstance(pieces, str):
        return pieces
    extras = {f.name: sorted(getattr(pieces.extras, f.name).items()) for f in dataclasses.fields(PieceExtras)}
    return repr(
        (
            as_rows(pieces),
            pieces.rows.tolist(),
            pieces.coords.tolist(),
            pieces.params,
            pieces.groups,
            pieces.norm_type,
            {k: (v.tolist(), pieces.counts[k].tolist()) for k, v in pieces.stats.items()},
            extras,
        )
    )


def as_rows(pieces) -> str:
    """The pieces as Piece objects, their mappings sorted (the JSON form keeps them sorted)."""
    return repr(
        [
            dataclasses.replace(
                p, tensors=dict(sorted(p.tensors.items())), stats=dict(sorted(p.stats.items()))
            )
            for p in pieces
        ]
    )


def careful(doc: dict, params=PARAMS):
    """The oracle: each piece through the careful decoder in order, then into columns as Piece
    objects; or the first DumpFormatError's message."""
    by_name, reader = {p.name: p for p in params}, _Reader("rank_00000.safetensors")
    columns = PieceColumnsBuilder(params)
    try:
        for i, raw in enumerate(doc["pieces"]):
            columns.add(Piece(**_decode_piece(reader, raw, f"pieces[{i}]", i, by_name)))
    except DumpFormatError as exc:
        return f"error: {exc}"
    return columns.result()


def decoded(doc: dict):
    """What the loader makes of the document's pieces, or its DumpFormatError's message."""
    try:
        return decode_rank(doc, "rank_00000.safetensors").pieces
    except DumpFormatError as exc:
        return f"error: {exc}"


def field_of(message: str) -> list[str]:
    """The field a refusal names, as its steps: ["pieces", "[3]", "regions", "[0]", "box"]."""
    found = re.fullmatch(r"error: rank_00000\.safetensors: metadata field (\S+): [^\n]+", message)
    assert found, message  # one line naming the file and the field
    return re.findall(r"\[\d+\]|[^.\[]+", found.group(1))


def agree(doc: dict, params=PARAMS) -> None:
    """Both decoders give equal pieces, or both refuse the document naming the same piece and field,
    one field path inside the other (the column checks may name `regions[0].box` where the careful
    decoder named `regions[0].box.offsets`, or the reverse); the wording may differ."""
    ours, theirs = decoded(doc), careful(doc, params)
    if isinstance(ours, str) or isinstance(theirs, str):
        assert isinstance(ours, str) and isinstance(theirs, str), (ours, theirs)
        a, b = field_of(ours), field_of(theirs)
        assert a[: len(b)] == b or b[: len(a)] == a, (ours, theirs)
    else:
        assert form(ours) == form(theirs)


def test_the_column_decoder_builds_the_pieces_the_careful_one_does():
    doc = _document()
    assert decoded(doc) == careful(doc) == _pieces()
    assert all(_quick_param(raw) == info for raw, info in zip(doc["params"], PARAMS, strict=False))


def test_decoded_rank_equals_the_encoded_one():
    decoded = decode_rank(_document(), "rank_00000.safetensors")
    assert decoded.pieces == _pieces()
    assert decoded.params == PARAMS


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False)
    | st.sampled_from(["nan", "inf", "-inf", "w", "b", "grad", "float32", "int8"])
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _paths(value, prefix=()):
    """Every (container path, key) inside a JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield prefix, key
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield prefix, i
            yield from _paths(item, prefix + (i,))


PIECE_FIELDS = (
    "param", "regions", "local_shape", "dtype", "local_name", "replica_group", "tensors", "stats",
    "box", "range", "offsets", "shape", "numel", "norm_type", "sum_pow", "sum_sq", "max_abs",
    "num_nan", "num_posinf", "num_neginf", "fingerprint", "grad", "grad_clipped", "other",
)  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    index=st.integers(min_value=0, max_value=2),
    choice=st.integers(min_value=0, max_value=10_000),
    action=st.sampled_from(["replace", "delete", "add"]),
    value=JSON_VALUES,
    new_key=st.sampled_from(PIECE_FIELDS),
)
def test_the_column_decoder_refuses_what_the_careful_one_refuses_alike(index, choice, action, value, new_key):
    doc = _document()
    raw = doc["pieces"][index]
    paths = list(_paths(raw))
    container_path, key = paths[choice % len(paths)]
    container = raw
    for step in container_path:
        container = container[step]
    if action == "replace":
        container[key] = value
    elif action == "delete":
        del container[key]
    elif isinstance(container, dict):
        container[new_key] = value
    else:
        container.append(value)
    agree(doc)


@pytest.mark.parametrize(
    "raw",
    [
        {"name": "w", "global_shape": [4, 6], "dtype": "float32"},
        {"name": "w", "global_shape": [4, -6], "dtype": "float32"},
        {"name": "w", "global_shape": [4, True], "dtype": "float32"},
        {"name": "w", "global_shape": [2**40, 2**40], "dtype": "float32"},
        {"name": "w", "global_shape": [2**63, 0], "dtype": "float32"},
        {"name": "w", "global_shape": [4, 6], "dtype": "int8"},
        {"name": 3, "global_shape": [4, 6], "dtype": "float32"},
        {"name": "w", "global_shape": (4, 6), "dtype": "float32"},
        ["w"],
    ],
)
def test_quick_param_decoder_declines_anything_unusual(raw):
    info = _quick_param(raw)
    if info is not None:
        assert info == ParamInfo(
            name=raw["name"], global_shape=tuple(raw["global_shape"]), dtype=raw["dtype"]
        )
        assert raw == {"name": "w", "global_shape": [4, 6], "dtype": "float32"}


TRICKY_VALUES = (
    None, True, False, 0, 1, -1, 7, 2**63, 0.0, -0.0, -0.5, 1.5, math.inf, "nan", "inf", "-inf", "",
    "w", "b", "x", "grad", "float32", "int8", [], [0], [1, 2], [-1, 3], [0.5], [2**63, 0], {}, {"range": [0, 1]},
)  # fmt: skip


@pytest.mark.parametrize("index", [0, 1, 2])
def test_every_field_of_a_piece_replaced_by_a_tricky_value_is_decoded_alike(index):
    """Exhaustive over the entry's fields: each replaced, and each deleted, one at a time."""
    original = _document()
    for container_path, key in list(_paths(original["pieces"][index])):
        for value in (*TRICKY_VALUES, "<delete>"):
            doc = copy.deepcopy(original)
            container = doc["pieces"][index]
            for step in container_path:
                container = container[step]
            if value == "<delete>":
                del container[key]
            else:
                container[key] = copy.deepcopy(value)
            agree(doc)


RANDOM_PARAMS = (
    ParamInfo(name="s", global_shape=(), dtype="float32"),
    ParamInfo(name="v", global_shape=(12,), dtype="bfloat16"),
    ParamInfo(name="m", global_shape=(3, 4), dtype="float32"),
    ParamInfo(name="t", global_shape=(2, 3, 2), dtype="float16"),
)


@st.composite
def random_stats(draw, numel: int, norm_type: float, width: int) -> TensorStats:
    nan = draw(st.integers(0, numel))
    finite = st.floats(min_value=0, max_value=1e30) | st.just(math.inf)
    return TensorStats(
        numel=numel,
        norm_type=draw(st.sampled_from([norm_type, norm_type, 1.0, math.inf])),
        sum_pow=draw(finite),
        sum_sq=draw(finite),
        max_abs=draw(finite),
        num_nan=nan,
        num_posinf=draw(st.integers(0, numel - nan)),
        fingerprint=tuple(
            draw(st.lists(st.floats(allow_infinity=True), min_size=width, max_size=width))
            if draw(st.integers(0, 9))
            else draw(st.lists(st.floats(), max_size=3))
        ),
    )


@st.composite
def random_piece(draw, index: int, norm_type: float, width: int) -> Piece:
    info = draw(st.sampled_from(RANDOM_PARAMS))
    numel, shape = info.numel, info.global_shape
    layout = draw(st.sampled_from(["range", "box", "ranges", "none"]))
    if layout == "box" or (layout == "range" and not shape):
        offsets = tuple(draw(st.integers(0, d)) for d in shape)
        sizes = tuple(draw(st.integers(0, d - o)) for d, o in zip(shape, offsets, strict=True))
        regions = (Box(offsets=offsets, shape=sizes),)
        local_shape = sizes if draw(st.booleans()) else (math.prod(sizes),)
    elif layout in ("range", "ranges"):
        cuts = sorted(
            draw(st.lists(st.integers(0, numel), min_size=2, max_size=2 if layout == "range" else 5))
        )
        regions = tuple(FlatRange(start=a, stop=b) for a, b in itertools.pairwise(cuts))
        covered = sum(r.numel for r in regions)
        local_shape = (covered,) if covered % 2 or draw(st.booleans()) else (2, covered // 2)
    else:
        regions, local_shape = (), (0,)
    covered = math.prod(local_shape)
    kinds = st.lists(st.sampled_from(TENSOR_KINDS), unique=True, max_size=2)
    stats = {k: draw(random_stats(covered, norm_type, width)) for k in draw(kinds)}
    names = st.none() | st.sampled_from(["dp", "tp", "w.0"])
    return Piece(
        index=index,
        param=info.name,
        regions=regions,
        local_shape=local_shape,
        dtype=draw(st.sampled_from([info.dtype, info.dtype, "float64"])),
        local_name=draw(names),
        replica_group=draw(names),
        tensors={k: f"{info.name}::{k}::{index}" for k in draw(kinds) if k not in stats},
        stats=stats,
        call_stats=tuple(
            draw(random_stats(covered, norm_type, width)) for _ in range(draw(st.sampled_from([0, 0, 2])))
        ),
        partial_group=draw(names),
    )


@st.composite
def random_document(draw) -> tuple[tuple[Piece, ...], dict]:
    norm_type, width = draw(st.sampled_from([2.0, 1.0, math.inf])), draw(st.integers(0, 3))
    pieces = tuple(draw(random_piece(i, norm_type, width)) for i in range(draw(st.integers(0, 8))))
    dump = RankDump(
        path="",
        rank=0,
        world_size=1,
        step=1,
        mode="stats",
        params=RANDOM_PARAMS,
        pieces=as_columns(RANDOM_PARAMS, pieces),
    )
    return pieces, parse_json(json.dumps(encode_rank(dump), allow_nan=False))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(random_document())
def test_random_valid_documents_decode_to_the_columns_of_their_pieces(case):
    pieces, doc = case
    before = as_columns(RANDOM_PARAMS, pieces)
    agree(doc, RANDOM_PARAMS)
    assert as_rows(decoded(doc)) == as_rows(before)  # the columns may differ: the norm type is the
    # first statistics', which the JSON form's sorted kinds can change


DEFECTS = {
    "param unknown": lambda p: p.__setitem__("param", "nope"),
    "param a number": lambda p: p.__setitem__("param", 3),
    "dtype unknown": lambda p: p.__setitem__("dtype", "int8"),
    "local shape too big": lambda p: p.__setitem__("local_shape", [math.prod(p["local_shape"]) + 1]),
    "local shape negative": lambda p: p.__setitem__("local_shape", [-1]),
    "regions not a list": lambda p: p.__setitem__("regions", {}),
    "a region outside": lambda p: p["regions"].append({"range": [10**6, 10**6]}),
    "a region of neither": lambda p: p["regions"].append({"other": 1}),
    "an unknown tensor kind": lambda p: p.__setitem__("tensors", {"weights": "k"}),
    "a tensor key not a string": lambda p: p.__setitem__("tensors", {"grad": 1}),
    "an unknown stats kind": lambda p: p.__setitem__("stats", {"weights": {}}),
    "stats numel off": lambda p: p.__setitem__("stats", {"grad": {"numel": -1, "norm_type": 2.0, "sum_pow": 0.0, "sum_sq": 0.0, "max_abs": 0.0}}),
    "a negative sum": lambda p: p.__setitem__("stats", {"grad": {"numel": math.prod(p["local_shape"]), "norm_type": 2.0, "sum_pow": -1.0, "sum_sq": 0.0, "max_abs": 0.0}}),
    "too many nonfinite": lambda p: p.__setitem__("call_stats", [{"numel": math.prod(p["local_shape"]), "norm_type": 2.0, "sum_pow": 0.0, "sum_sq": 0.0, "max_abs": 0.0, "num_nan": math.prod(p["local_shape"]) + 1}]),
    "norm type zero": lambda p: p.__setitem__("call_stats", [{"numel": math.prod(p["local_shape"]), "norm_type": 0, "sum_pow": 0.0, "sum_sq": 0.0, "max_abs": 0.0}]),
    "a fingerprint too long": lambda p: p.__setitem__("call_stats", [{"numel": math.prod(p["local_shape"]), "norm_type": 2.0, "sum_pow": 0.0, "sum_sq": 0.0, "max_abs": 0.0, "fingerprint": [0.0] * 65}]),
    "a group not a string": lambda p: p.__setitem__("replica_group", ["dp"]),
    "not an object": lambda p: p.clear(),
}  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(random_document(), st.integers(0, 7), st.sampled_from(sorted(DEFECTS)))
def test_a_random_single_defect_is_refused_naming_its_piece(case, choice, defect):
    _, doc = case
    if not doc["pieces"]:
        return
    index = choice % len(doc["pieces"])
    DEFECTS[defect](doc["pieces"][index])
    if defect == "not an object":
        doc["pieces"][index] = []
    refused = decoded(doc)
    assert isinstance(refused, str) and field_of(refused)[:2] == ["pieces", f"[{index}]"], (defect, refused)
    agree(doc, RANDOM_PARAMS)
