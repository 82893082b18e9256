"""Format-1.1 pieces stay columns: a sequence that builds each Piece when asked, equal to the tuple."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from dumpfile.formats import json_reports, rewrite_columns, stats_step, write_json_1_0
from gradaudit.dumpfile import load_rank_file
from gradaudit.dumpfile.columnar import ColumnarPieces, ParamIds, counts_key
from gradaudit.errors import DumpFormatError

_COMPARED_COLUMNS = (
    "rank",
    "index",
    "has_grad",
    "term",
    "sum_sq",
    "counts",
    "unknown",
    "has_clipped",
    "max_abs",
    "numel",
)
"""The step table's columns the object oracle and the table must give alike (`_columns`)."""


def _columns(table):
    """The step table's columns by the oracle's names."""
    from gradaudit.norms import UNKNOWN

    grad = table.grad
    return {
        "rank": table.rank,
        "index": table.index,
        "has_grad": grad.has,
        "term": grad.term,
        "sum_sq": grad.sum_sq,
        "max_abs": grad.max_abs,
        "numel": table.numel,
        "counts": grad.counts,
        "unknown": (grad.flags & UNKNOWN) > 0,
        "has_clipped": table.has_clipped,
        "by_rank_order": table.by_rank_order,
        "has_dots": table.has_dots,
        "dot_pre_post": table.dot_pre_post,
        "dot_pre_pre": table.dot_pre_pre,
    }


def _clip(norm_type, loss_scale):
    """The clip of the random steps measured both ways: reported 3 against max_norm 1, loss-scaled or not."""
    from gradaudit.model import ClipRecord

    return ClipRecord(
        max_norm=1.0,
        reported_norm=3.0,
        norm_type=norm_type,
        loss_scale=loss_scale,
        unscaled_before_clip=None if loss_scale is None else False,
    )


def _both_forms(tmp_path, rank=1):
    path = stats_step(tmp_path / "v11", rank=rank, world_size=2)
    columnar = load_rank_file(path)
    write_json_1_0(tmp_path / "v10", columnar)
    return columnar, load_rank_file(tmp_path / "v10" / path.name)


def test_columnar_pieces_equal_the_tuple_the_json_form_of_the_same_rank_gives(tmp_path):
    columnar, json_form = _both_forms(tmp_path)
    pieces, expected = columnar.pieces, tuple(json_form.pieces)
    assert isinstance(pieces, ColumnarPieces) and isinstance(json_form.pieces, ColumnarPieces)
    assert pieces == expected and expected == pieces
    assert (pieces != expected) is False
    assert tuple(pieces) == expected and list(pieces) == list(expected)
    assert [pieces[i] for i in range(len(pieces))] == list(expected)
    assert pieces[-1] == expected[-1] and pieces[1:] == expected[1:]
    assert load_rank_file(columnar.path).pieces == pieces
    with pytest.raises(IndexError):
        pieces[len(expected)]


def test_columnar_pieces_differ_from_a_tuple_with_one_piece_changed(tmp_path):
    import dataclasses

    columnar, json_form = _both_forms(tmp_path)
    changed = list(json_form.pieces)
    changed[1] = dataclasses.replace(changed[1], replica_group="other")
    assert columnar.pieces != tuple(changed)
    assert columnar.pieces != json_form.pieces[:-1]


def test_the_columns_of_columnar_pieces_are_read_only_and_give_sizes_and_layouts(tmp_path):
    columnar, json_form = _both_forms(tmp_path)
    pieces = columnar.pieces
    assert isinstance(pieces, ColumnarPieces)
    with pytest.raises(ValueError):
        pieces.rows[0, 0] = 1
    assert pieces.numel.tolist() == [p.numel for p in json_form.pieces]
    width = pieces.layout_width
    layouts = np.stack([pieces.layout_column(c, width) for c in range(2 + width)], axis=1).tolist()
    keys = [p.layout_key for p in json_form.pieces]
    for i in range(len(keys)):
        for j in range(len(keys)):
            assert (layouts[i] == layouts[j]) == (keys[i] == keys[j])
    ids = ParamIds(["emb", "layers.0.w", "norm"])
    assert ids.of(pieces).tolist() == [1, 0, 2]


def test_columnar_pieces_stay_read_only_and_equal_through_a_pickle(tmp_path):
    import pickle

    columnar, _ = _both_forms(tmp_path)
    back = pickle.loads(pickle.dumps(columnar.pieces))
    assert isinstance(back, ColumnarPieces) and back == columnar.pieces
    for array in (back.rows, back.coords, *back.stats.values(), *back.counts.values()):
        with pytest.raises(ValueError):
            array[0] = 1


def test_a_box_with_more_nonfinite_values_than_elements_is_refused_naming_the_piece(tmp_path):
    path = stats_step(tmp_path, world_size=1)
    rewrite_columns(path, lambda a, d: a[counts_key("grad")].__setitem__((0, 1), 10**6))
    with pytest.raises(DumpFormatError, match="piece 0: more nonfinite values than elements"):
        load_rank_file(path)


def _step_in_both_forms(tmp_path, world_size=2):
    from gradaudit.dumpfile import load_step

    for rank in range(world_size):
        stats_step(tmp_path / "v11", rank=rank, world_size=world_size)
        write_json_1_0(tmp_path / "v10", load_rank_file(tmp_path / "v11" / f"rank_{rank:05d}.safetensors"))
    return load_step(tmp_path / "v10"), load_step(tmp_path / "v11")


def test_measuring_columnar_ranks_gives_the_measurements_of_their_json_form(tmp_path):
    from builders import assert_same_measurements

    from gradaudit.dumpfile.reader import TensorReader
    from gradaudit.measure.measure import measure_step

    json_step, columnar_step = _step_in_both_forms(tmp_path)
    with TensorReader(json_step) as reader:
        expected = measure_step(json_step, reader, workers=1)
    with TensorReader(columnar_step) as reader:
        measured = measure_step(columnar_step, reader, workers=1)
    assert measured.params["norm"].replica_sets  # the replicated whole piece, compared by fingerprint
    assert_same_measurements(measured, expected)
    with TensorReader(columnar_step) as reader:
        part = measure_step(columnar_step, reader, params=["emb"], workers=1)
    whole = expected.table
    emb = whole.param == whole.param_names.index("emb")
    assert part.table.size == int(emb.sum()) > 0
    for name in ("rank", "index", "numel"):
        assert getattr(part.table, name).tolist() == getattr(whole, name)[emb].tolist(), name
    assert part.table.grad.term.tolist() == whole.grad.term[emb].tolist()


def test_measurements_of_columnar_ranks_pickle_as_their_table(tmp_path):
    import pickle

    import numpy as np
    from builders import assert_same_measurements

    from gradaudit.dumpfile.reader import TensorReader
    from gradaudit.measure.measure import measure_step

    _, columnar_step = _step_in_both_forms(tmp_path)
    with TensorReader(columnar_step) as reader:
        measured = measure_step(columnar_step, reader, workers=1)
    back = pickle.loads(pickle.dumps(measured))
    assert_same_measurements(back, measured)
    assert np.array_equal(back.table.grad.term, measured.table.grad.term, equal_nan=True)


def _random_step(tmp_path, seed: int, world_size: int = 4, clip=None, values=False):
    """Ranks holding random flat ranges and boxes (some the same on several ranks: replicas), some
    with nonfinite values, as columns (v11) and as JSON (v10); `values`: their gradients and
    clipped gradients dumped with values too (full mode, v11 only)."""
    import math
    import random

    import torch
    from builders import FIXED

    from gradaudit.capture.build import box, flat, write_rank
    from gradaudit.dumpfile import load_step
    from gradaudit.model import ClipRecord

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shared = [("f", rng.randrange(0, 40), rng.randrange(1, 9)), ("b", (rng.randrange(0, 4), 0), (4, 6))]
    for rank in range(world_size):
        pieces = []
        for _ in range(rng.randrange(1, 5)):
            if rng.random() < 0.5:
                start, size = rng.randrange(0, 40), rng.randrange(1, 9)
                if rng.random() < 0.4:
                    _, start, size = shared[0]
                grad = torch.randn(size, generator=gen)
                if rng.random() < 0.2:
                    grad[0] = math.inf
                extra = {"grad_clipped": grad * 0.5} if values else {"stats_only": True}
                pieces.append(flat("f", start, grad=grad, **extra))
            else:
                offsets, shape = (
                    (rng.randrange(0, 5), rng.randrange(0, 3)),
                    (rng.randrange(1, 4), rng.randrange(1, 4)),
                )
                if rng.random() < 0.4:
                    _, offsets, shape = shared[1]
                grad = torch.randn(*shape, generator=gen)
                if rng.random() < 0.2:
                    grad[0, 0] = math.nan
                extra = {"grad_clipped": grad * 0.5} if values else {"stats_only": True}
                pieces.append(box("b", offsets, grad=grad, replica_group="dp", **extra))
        write_rank(
            tmp_path / "v11",
            rank=rank,
            world_size=world_size,
            step=1,
            params={"f": (48,), "b": (8, 6)},
            pieces=pieces,
            clip=clip or ClipRecord(max_norm=1.0, reported_norm=3.0),
            **FIXED,
        )
        if not values:
            write_json_1_0(
                tmp_path / "v10", load_rank_file(tmp_path / "v11" / f"rank_{rank:05d}.safetensors")
            )
    return None if values else load_step(tmp_path / "v10"), load_step(tmp_path / "v11")


def _measured_as_by_objects(step, oracle=None):
    """`step` measured through its column table, its parameters' measurements (replica sets too)
    asserted equal to those of `oracle` (`step` unless given) measured piece object by piece
    object; both measurements."""
    from gradaudit.dumpfile.reader import TensorReader
    from gradaudit.measure.measure import measure_step

    expected = _measured_by_objects(step if oracle is None else oracle)
    with TensorReader(step) as reader:
        ours = measure_step(step, reader, workers=1)
    assert ours.params == expected.params
    return ours, expected


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Row:
    """The oracle's row: one piece measured, its gradients' statistics divided by `value_scale`."""

    rank: int
    index: int
    param: str
    regions: tuple
    dtype: str
    numel: int
    stats: dict
    dot_pre_post: float | None
    dot_pre_pre: float | None
    value_scale: float

    @property
    def layout_key(self):
        return (self.param, self.regions)


def _measured_by_objects(step):
    """The oracle: `step` measured piece object by piece object (each piece's stored statistics,
    the gradient's divided by its rank's loss scale; replicas compared by fingerprint one set at a
    time), not through the step's column table: its parameters' measurements and the rows."""
    from gradaudit.dumpfile.reader import TensorReader
    from gradaudit.measure.kernel import ChunkKernel
    from gradaudit.measure.measurements import SCALED_KINDS, gradient_scale_of, unscaled_stats
    from gradaudit.norms import divide_by_power
    from gradaudit.steptable import ParamMeasurement

    norm_type = step.clip.norm_type if step.clip is not None else 2.0
    reader, held = TensorReader(step), {}
    for rank in step.ranks_present:
        dump = step.ranks[rank]
        scale = gradient_scale_of(dump.clip)
        for piece in dump.pieces:
            stats, products = piece.stats, (None, None, None)
            if piece.tensors:  # read from the values, which win over the stored statistics
                read, *products = ChunkKernel().read_piece(
                    reader, dump.path, piece.tensors, piece.numel, norm_type
                )
                stats = {**piece.stats, **read}
                if products[0] is not None and scale != 1.0:
                    products[:2] = [divide_by_power(v, scale, 2.0) for v in products[:2]]
            row = _Row(
                rank=rank,
                index=piece.index,
                param=piece.param,
                regions=piece.regions,
                dtype=piece.dtype,
                numel=piece.numel,
                stats={k: unscaled_stats(v, scale) if k in SCALED_KINDS else v for k, v in stats.items()},
                dot_pre_post=products[0],
                dot_pre_pre=products[1],
                value_scale=scale,
            )
            held.setdefault(piece.param, []).append(((rank, dump.path, piece), row))
    params, rows = {}, []
    for name in sorted(step.params):
        entries = held.get(name, [])
        pieces = tuple(sorted((m for _, m in entries), key=lambda m: (m.rank, m.index)))
        rows += pieces
        by_layout = {}
        for entry, _ in entries:
            by_layout.setdefault(entry[2].layout_key, []).append(entry)
        lookup = {(m.rank, m.index): (m.stats.get("grad"), m.value_scale) for m in pieces}
        replicated = sorted(
            (copies for copies in by_layout.values() if len(copies) > 1),
            key=lambda copies: min((r, p.index) for r, _, p in copies),
        )
        params[name] = ParamMeasurement(
            param=name,
            norm_type=norm_type,
            replica_sets=tuple(
                _replica_set_by_objects(reader, copies, lookup, 1 << 16) for copies in replicated
            ),
        )
    reader.close()
    return SimpleNamespace(norm_type=norm_type, params=params, rows=tuple(rows), names=tuple(step.params))


def _replica_set_by_objects(reader, copies, measured, chunk):
    """The oracle of one replica set: every copy compared with the lowest (rank, index) copy one
    object at a time, by values when all hold gradient values, else by their stored fingerprints
    (`measured`: (rank, index) -> (the copy's gradient statistics, its value scale))."""
    from gradaudit.measure.measure import _differences
    from gradaudit.steptable import ReplicaCopy, ReplicaSet

    copies = sorted(copies, key=lambda c: (c[0], c[2].index))
    base_rank, _, base = copies[0]
    base_stats = measured[(base_rank, base.index)][0]
    scaled = [(rank, path, piece, measured[(rank, piece.index)][1]) for rank, path, piece in copies]
    by_values = all("grad" in piece.tensors for _, _, piece in copies)
    if by_values:
        compared = _differences(reader, scaled, "grad", chunk)[0]
        results = [
            ReplicaCopy(rank=rank, index=piece.index, max_abs_diff=diff, num_nonfinite_mismatch=mismatch)
            for (rank, _, piece, _), (diff, mismatch) in zip(scaled[1:], compared, strict=True)
        ]
    else:
        results = [
            ReplicaCopy(
                rank=rank,
                index=piece.index,
                fingerprint_delta=_fingerprint_delta(measured[(rank, piece.index)][0], base_stats),
            )
            for rank, _, piece in copies[1:]
        ]
    param_base_max_abs = None
    if all("param_before" in piece.tensors for _, _, piece in copies):
        diffs, param_base_max_abs = _differences(reader, scaled, "param_before", chunk)
        results = [replace(c, param_max_abs_diff=d) for c, (d, _) in zip(results, diffs, strict=True)]
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
        param_base_max_abs=param_base_max_abs,
    )


def _fingerprint_delta(stats, base):
    """The largest difference of a copy's fingerprint, norm and largest |g| from the base copy's
    (inf when their nonfinite counts differ); None when either has no statistics to compare."""
    if stats is None or base is None or len(stats.fingerprint) != len(base.fingerprint):
        return None
    if stats.num_nonfinite != base.num_nonfinite:
        return math.inf
    return max(
        [abs(a - b) for a, b in zip(stats.fingerprint, base.fingerprint, strict=True)]
        + [abs(math.sqrt(stats.sum_sq) - math.sqrt(base.sum_sq)), abs(stats.max_abs - base.max_abs)]
    )


class _ObjectColumns:
    """The oracle of the step table: its columns computed from the measurement objects one by one."""

    def __init__(self, m):
        import math

        import numpy as np

        from gradaudit.norms import term_of

        self.pieces = pieces = m.rows
        self.norm_type, self.param_names = m.norm_type, m.names
        ids = {}
        self.layout = np.array([ids.setdefault(p.layout_key, len(ids)) for p in pieces], dtype=np.int64)
        self.rank = np.array([p.rank for p in pieces], dtype=np.int64)
        self.index = np.array([p.index for p in pieces], dtype=np.int64)
        self.dtypes = frozenset(p.dtype for p in pieces)
        stats = [p.stats.get("grad") for p in pieces]
        self.has_grad = np.array([s is not None for s in stats], dtype=bool)
        self.sum_sq = np.array([0.0 if s is None else s.sum_sq for s in stats])
        self.max_abs = np.array([0.0 if s is None else s.max_abs for s in stats])
        self.numel = np.array([p.numel for p in pieces], dtype=np.int64)
        self.param = np.array([m.names.index(p.param) for p in pieces], dtype=np.int64)
        self.counts = np.array(
            [(0, 0, 0) if s is None else (s.num_nan, s.num_posinf, s.num_neginf) for s in stats],
            dtype=np.int64,
        ).reshape(len(stats), 3)
        terms = [0.0 if s is None else term_of(s, m.norm_type) for s in stats]
        self.term = np.array([math.nan if t is None else t for t in terms])
        self.unknown = np.array([t is None for t in terms], dtype=bool)
        self.has_clipped = np.array(["grad_clipped" in p.stats for p in pieces], dtype=bool)
        self.has_dots = np.array([p.dot_pre_post is not None for p in pieces], dtype=bool)
        self.dot_pre_post = np.array([p.dot_pre_post or 0.0 for p in pieces])
        self.dot_pre_pre = np.array([p.dot_pre_pre or 0.0 for p in pieces])
        self.by_rank_order = np.lexsort((self.index, self.rank))
        self.grad = SimpleNamespace(
            has=self.has_grad,
            sum_sq=self.sum_sq,
            term=self.term,
            max_abs=self.max_abs,
            counts=self.counts,
        )

    def cover_positions(self):
        import numpy as np

        first = {}
        for i in self.by_rank_order.tolist():
            first.setdefault(self.pieces[i].layout_key, i)
        return np.array(list(first.values()), dtype=np.int64)


@pytest.mark.parametrize(
    ("seed", "norm_type", "loss_scale"),
    [*((seed, 2.0, None) for seed in range(6)), (6, 2.0, 1024.0), (7, float("inf"), 3.0), (8, 3.0, 2.0**40)],
)
def test_the_step_columns_of_a_table_equal_those_of_the_objects_on_random_layouts(
    tmp_path, capsys, seed, norm_type, loss_scale
):
    """The oracle is the object path; with a loss scale (the gradients dumped before unscale_) the
    table divides its columns by it as each piece's statistics are."""
    import numpy as np

    from gradaudit.dumpfile.reader import TensorReader
    from gradaudit.measure.measure import measure_step, overflow_notes

    clip = _clip(norm_type, loss_scale)
    json_step, columnar_step = _random_step(tmp_path, seed, clip=clip)
    ours, expected = _measured_as_by_objects(columnar_step, oracle=json_step)
    a, b = _ObjectColumns(expected), ours.table
    for name in (*_COMPARED_COLUMNS, "by_rank_order"):
        assert np.array_equal(getattr(a, name), _columns(b)[name], equal_nan=True), name
    same = a.layout[:, None] == a.layout[None, :]
    assert np.array_equal(same, b.layout[:, None] == b.layout[None, :])
    assert np.array_equal(a.cover_positions(), b.cover) and a.dtypes == b.dtypes
    assert [b.param_names[i] for i in b.param.tolist()] == [p.param for p in expected.rows]
    assert not b.has_update.any()
    assert overflow_notes(a) == overflow_notes(b)
    from gradaudit.analysis.hypotheses import groups_of
    from gradaudit.analysis.norm_input import norm_input_of, param_signatures

    json_measured = measure_step(json_step, TensorReader(json_step), workers=1)
    signatures = [
        param_signatures(norm_input_of(s, m, m.table))
        for s, m in ((json_step, json_measured), (columnar_step, ours))
    ]
    assert signatures[0] == signatures[1]
    assert groups_of(signatures[1]) == _param_groups(expected.rows)
    reports = json_reports(capsys, tmp_path / "v10", tmp_path / "v11")
    assert reports[0] == reports[1]


@pytest.mark.parametrize(
    ("seed", "norm_type", "loss_scale"),
    [(10, 2.0, None), (11, 2.0, 1024.0), (12, float("inf"), 3.0), (13, 3.0, 2.0)],
)
def test_the_columns_of_a_full_mode_step_equal_those_of_its_pieces_read_one_by_one(
    tmp_path, seed, norm_type, loss_scale
):
    """The tensor pass writes what it reads into the table; the oracle reads each piece's values
    into an object, and compares the replicas value by value, one set at a time."""
    import numpy as np

    from gradaudit.measure.measure import overflow_notes

    clip = _clip(norm_type, loss_scale)
    _, step = _random_step(tmp_path, seed, clip=clip, values=True)
    ours, expected = _measured_as_by_objects(step)
    compared = any(s.by_values for pm in ours.params.values() for s in pm.replica_sets)
    assert compared or seed != 10  # seed 10 holds replicas, compared value by value
    a, b = _ObjectColumns(expected), ours.table
    for name in _COMPARED_COLUMNS:
        assert np.array_equal(getattr(a, name), _columns(b)[name], equal_nan=True), name
    for name in ("has_dots", "dot_pre_post", "dot_pre_pre"):
        assert np.array_equal(getattr(a, name), _columns(b)[name]), name
    assert b.has_dots.all() and np.array_equal(a.cover_positions(), b.cover)
    assert overflow_notes(a) == overflow_notes(b)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_norms_of_term_arrays_equal_those_of_their_floats(norm_type):
    import random

    import numpy as np

    from gradaudit.norms import _CHUNK, norm_of_terms, safe_fsum

    rng = random.Random(int(norm_type) if norm_type != float("inf") else 7)
    cases = [[], [0.0], [1e308, 1e308], [float("inf"), 1.0], [1e-300] * 5]
    for _ in range(40):
        size = rng.choice([1, 5, 100, _CHUNK + 3])
        scale = rng.choice([1.0, 1e-200, 1e300])
        cases.append([rng.random() * scale for _ in range(size)])
    for terms in cases:
        array = np.array(terms, dtype=np.float64)
        assert safe_fsum(array) == safe_fsum(terms)
        assert norm_of_terms(array, norm_type) == norm_of_terms(terms, norm_type)


def test_a_step_mixing_columnar_and_json_ranks_is_measured_and_reported_as_its_json_form(tmp_path, capsys):
    import shutil

    import numpy as np
    from builders import assert_same_measurements

    from gradaudit.dumpfile import load_step
    from gradaudit.dumpfile.reader import TensorReader
    from gradaudit.measure.measure import measure_step

    json_step, _ = _step_in_both_forms(tmp_path)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(tmp_path / "v11" / "rank_00000.safetensors", mixed)
    for table in (tmp_path / "v11").glob("params_*.safetensors"):
        shutil.copy(table, mixed)
    shutil.copy(tmp_path / "v10" / "rank_00001.safetensors", mixed)
    step = load_step(mixed)
    with TensorReader(step) as reader:
        measured = measure_step(step, reader, workers=1)
    expected = _measured_by_objects(json_step)
    assert measured.params == expected.params
    a, b = _ObjectColumns(expected), measured.table
    for name in _COMPARED_COLUMNS:
        assert np.array_equal(getattr(a, name), _columns(b)[name], equal_nan=True), name
    with TensorReader(json_step) as reader:
        assert_same_measurements(measured, measure_step(json_step, reader, workers=1))
    reports = json_reports(capsys, tmp_path / "v10", mixed)
    assert reports[0] == reports[1]


def test_columnar_ranks_with_clipped_gradient_statistics_give_the_report_of_their_json_form(tmp_path, capsys):
    import torch
    from builders import FIXED

    from gradaudit.capture.build import flat, write_rank
    from gradaudit.model import ClipRecord

    gen = torch.Generator().manual_seed(3)
    for rank in range(2):
        grad = torch.randn(20, generator=gen)
        write_rank(
            tmp_path / "v11",
            rank=rank,
            world_size=2,
            step=1,
            params={"w": (40,)},
            pieces=[flat("w", 20 * rank, grad=grad, grad_clipped=grad * 0.5, stats_only=True)],
            clip=ClipRecord(max_norm=1.0, reported_norm=2.0, clip_coef=0.4),
            **FIXED,
        )
        dump = load_rank_file(tmp_path / "v11" / f"rank_{rank:05d}.safetensors")
        assert isinstance(dump.pieces, ColumnarPieces) and dump.pieces.kinds == ("grad", "grad_clipped")
        write_json_1_0(tmp_path / "v10", dump)
    reports = json_reports(capsys, tmp_path / "v10", tmp_path / "v11")
    assert reports[0] == reports[1]
    assert all(
        row["applied_clip_coef"] == pytest.approx(0.5) for row in reports[1]["ranks"]
    )  # from the stats


def test_sorting_by_a_combined_key_orders_rows_as_lexsort_does():
    import numpy as np

    from gradaudit.measure.table import _sorting

    rng = np.random.default_rng(5)
    for high in (3, 1000, 2**40):
        keys = [rng.integers(-1, high, size=500) for _ in range(4)]
        keys[0] = rng.integers(0, 7, size=500)
        order = _sorting(keys)
        rows = np.stack(keys, axis=1)[order]
        assert np.array_equal(rows, np.stack(keys, axis=1)[np.lexsort(keys[::-1])])


def test_an_hsdp_stats_step_with_one_drifted_replica_reports_ga601_as_its_json_form(tmp_path, capsys):
    """Every piece replicated (2 shards x 3 replicas): the table compares the copies on its columns."""
    import torch
    from builders import FIXED

    from gradaudit.capture.build import flat, write_rank
    from gradaudit.model import ClipRecord, Topology

    gen = torch.Generator().manual_seed(3)
    shards = [torch.randn(6, generator=gen) for _ in range(2)]
    groups = {"replicate": ((0, 2, 4), (1, 3, 5)), "shard": ((0, 1), (2, 3), (4, 5))}
    for rank in range(6):
        grad = shards[rank % 2].clone()
        if rank == 5:
            grad[2] += 1e-3  # one copy drifted
        write_rank(
            tmp_path / "v11",
            rank=rank,
            world_size=6,
            step=1,
            params={"w": (12,)},
            pieces=[flat("w", 6 * (rank % 2), grad=grad, stats_only=True, replica_group="replicate")],
            clip=ClipRecord(max_norm=10.0, reported_norm=float(torch.cat(shards).double().norm())),
            topology=Topology(groups=groups),
            **FIXED,
        )
        write_json_1_0(tmp_path / "v10", load_rank_file(tmp_path / "v11" / f"rank_{rank:05d}.safetensors"))
    reports = json_reports(capsys, tmp_path / "v10", tmp_path / "v11")
    assert reports[0] == reports[1]
    assert [f["code"] for f in reports[1]["findings"]].count("GA601") == 1
    assert "5" in json.dumps([f for f in reports[1]["findings"] if f["code"] == "GA601"])


def _param_groups(pieces):
    """The oracle of hypotheses.groups_of over the columns: the parameters grouped by how their pieces
    are held (ranks holding one, most copies of one layout), counted piece by piece."""
    from gradaudit.analysis.hypotheses import groups_of

    holders, copies = {}, {}
    for piece in pieces:
        holders.setdefault(piece.param, set()).add(piece.rank)
        copies[(piece.param, piece.regions)] = copies.get((piece.param, piece.regions), 0) + 1
    most = {}
    for (param, _), n in copies.items():
        most[param] = max(most.get(param, 0), n)
    return groups_of({param: (len(ranks), most[param]) for param, ranks in holders.items()})
