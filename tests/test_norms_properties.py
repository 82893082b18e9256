"""Property tests of the norm math: any disjoint cover of a tensor, with replicas, gives its norm."""

import dataclasses
import itertools
import math
import random

import torch
from builders import step_table_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradaudit.analysis.geometry import coverage, region_boxes
from gradaudit.analysis.norm_input import cover_norm
from gradaudit.capture.tensorstats import stats_of_tensor
from gradaudit.model import Box, FlatRange
from gradaudit.norms import expected_clip_coef

NORM_TYPES = (1.0, 2.0, 3.5, math.inf)


@st.composite
def cut_tensors(draw):
    """(tensor, [(region, values)]) where the regions are a disjoint cover, by flat ranges or a box grid."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e6]))
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    numel = tensor.numel()
    if draw(st.booleans()):
        cuts = sorted(set(draw(st.lists(st.integers(0, numel), max_size=6))) | {0, numel})
        pieces = [
            (FlatRange(start=a, stop=b), tensor.reshape(-1)[a:b])
            for a, b in itertools.pairwise(cuts)
            if b > a
        ]
    else:
        per_dim = [sorted(set(draw(st.lists(st.integers(0, n), max_size=3))) | {0, n}) for n in shape]
        spans = [[(a, b) for a, b in itertools.pairwise(c) if b > a] for c in per_dim]
        pieces = []
        for combo in _product(spans):
            offsets = tuple(a for a, _ in combo)
            sizes = tuple(b - a for a, b in combo)
            index = tuple(slice(a, b) for a, b in combo)
            pieces.append((Box(offsets=offsets, shape=sizes), tensor[index].reshape(-1)))
    return tensor, pieces


def _product(lists):
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for rest in _product(lists[1:]):
            yield (head,) + rest


def _measurements(pieces, norm_type, rng, num_ranks=4, replica_chance=0.5):
    """(rank, index, layout, stats) rows with every piece on a random rank, some copied onto other ranks."""
    found = []
    next_index = dict.fromkeys(range(num_ranks), 0)
    for layout, (_, values) in enumerate(pieces):
        ranks = {rng.randrange(num_ranks)}
        while rng.random() < replica_chance and len(ranks) < num_ranks:
            ranks.add(rng.randrange(num_ranks))
        for rank in sorted(ranks):
            found.append((rank, next_index[rank], layout, stats_of_tensor(values, norm_type)))
            next_index[rank] += 1
    return found


def _entries(rows):
    """Entries from (rank, layout, term, flags) rows in (rank, entry) order."""
    import numpy as np

    from gradaudit.analysis.norm_input import Entries

    rank, layout, term, flags = zip(*rows, strict=True) if rows else ((), (), (), ())
    return Entries(
        rank=np.array(rank, dtype=np.int64),
        layout=np.array(layout, dtype=np.int64),
        term=np.array(term, dtype=np.float64),
        flags=np.array(flags, dtype=np.int8),
    )


def _cover_norm(rows, norm_type):
    table = step_table_of(rows, norm_type)
    return cover_norm(table, table.cover, table.grad, norm_type)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=cut_tensors(), norm_type=st.sampled_from(NORM_TYPES), seed=st.integers(0, 1000))
def test_a_disjoint_cover_with_replicas_gives_the_norm_of_the_reassembled_tensor(cut, norm_type, seed):
    tensor, pieces = cut
    measured = _measurements(pieces, norm_type, random.Random(seed))
    got = _cover_norm(measured, norm_type)
    expected = float(torch.linalg.vector_norm(tensor, ord=norm_type))
    assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-300)


@settings(max_examples=40, deadline=None)
@given(cut=cut_tensors(), norm_type=st.sampled_from(NORM_TYPES), seed=st.integers(0, 1000))
def test_permuting_pieces_changes_nothing(cut, norm_type, seed):
    _, pieces = cut
    rng = random.Random(seed)
    measured = _measurements(pieces, norm_type, rng)
    shuffled = list(measured)
    rng.shuffle(shuffled)
    assert _cover_norm(shuffled, norm_type) == _cover_norm(measured, norm_type)


@settings(max_examples=40, deadline=None)
@given(cut=cut_tensors(), seed=st.integers(0, 1000))
def test_a_disjoint_cover_has_no_gap_and_no_overlap_and_dropping_a_piece_leaves_its_gap(cut, seed):
    tensor, pieces = cut
    shape = tuple(tensor.shape)
    boxes = [(o, s, i) for i, (region, _) in enumerate(pieces) for o, s in region_boxes(region, shape)]
    whole = coverage(boxes, shape)
    assert (whole.num_gap_elements, whole.num_overlap_elements) == (0, 0)
    dropped = random.Random(seed).randrange(len(pieces))
    rest = coverage([b for b in boxes if b[2] != dropped], shape)
    assert rest.num_gap_elements == pieces[dropped][0].numel and rest.num_overlap_elements == 0


@given(
    norm=st.floats(min_value=0, allow_infinity=True, allow_nan=False),
    max_norm=st.floats(min_value=1e-30, max_value=1e30, allow_nan=False),
)
def test_the_clip_coefficient_is_never_above_one(norm, max_norm):
    coef = expected_clip_coef(norm, max_norm)
    assert 0 <= coef <= 1


@st.composite
def random_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    boxes = []
    for tag in range(draw(st.integers(0, 6))):
        offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
        sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=False))
        boxes.append((offsets, sizes, tag))
    return shape, boxes


@settings(max_examples=150, deadline=None)
@given(case=random_boxes())
def test_the_coverage_sweep_counts_gaps_and_overlaps_like_a_dense_count_of_every_element(case):
    shape, boxes = case
    counts = torch.zeros(shape, dtype=torch.int64)
    for offsets, sizes, _ in boxes:
        counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))] += 1
    result = coverage(boxes, shape)
    assert result.num_gap_elements == int((counts == 0).sum())
    assert result.num_overlap_elements == int((counts - 1).clamp(min=0).sum())
    shared = set()
    for offsets, sizes, tag in boxes:
        if bool((counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))] > 1).any()):
            shared.add(tag)
    assert result.overlapping_tags == shared


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cut=cut_tensors(),
    norm_type=st.sampled_from(NORM_TYPES),
    seed=st.integers(0, 1000),
    chosen=st.sets(st.integers(0, 3), min_size=1),
)
def test_the_norm_of_a_set_of_entries_is_that_of_its_pieces(cut, norm_type, seed, chosen):
    """NormSet (the diagnosis' one norm of a set of entries) against the object path, its oracle:
    any set of ranks, replicas once through the first rank's copy or every copy counted."""
    from collections import namedtuple

    from gradaudit.analysis.norm_input import NormSet
    from gradaudit.norms import flags_of_stats, norm_of_terms, term_of

    _, pieces = cut
    rng = random.Random(seed)
    Row = namedtuple("Row", "rank index layout stats")
    measured = [  # copies that drifted apart, so that which rank's copy counts shows
        Row(rank, index, layout, stats_of_tensor(pieces[layout][1] * (1 + rank / 8), norm_type))
        for rank, index, layout, _ in sorted(_measurements(pieces, norm_type, rng))
    ]
    entries = _entries([(p.rank, p.layout, term_of(p.stats, norm_type), 0) for p in measured])
    assert all(flags_of_stats(p.stats, term_of(p.stats, norm_type)) == 0 for p in measured)
    norms = NormSet(entries, norm_type)
    inside = [p for p in measured if p.rank in chosen]
    first = rng.choice(sorted(chosen))
    firsts = sorted(inside, key=lambda p: (p.rank != first, p.rank, p.index))
    once, repeated = norms.norm(tuple(chosen), True, first=first)

    def norm_of(counted):  # the oracle: every piece's term, as given
        return norm_of_terms([term_of(p.stats, norm_type) for p in counted], norm_type)

    assert once == norm_of(list({p.layout: p for p in reversed(firsts)}.values()))
    assert norms.norm(tuple(chosen), False)[0] == norm_of(inside)
    assert repeated == (len({p.layout for p in inside}) < len(inside))


_SUMMABLE = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=0.0, max_value=1e6),
    st.floats(min_value=-1e-300, max_value=1e-300),  # subnormals among them
    st.sampled_from([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 2.0**-1074, 1.7e308]),
)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.lists(_SUMMABLE, max_size=60),
        st.lists(st.floats(min_value=-1e6, max_value=1e6), max_size=60),  # the exact path, no fallback
        st.lists(st.floats(min_value=-1e-300, max_value=1e-300), max_size=60),
    ),
    st.lists(st.integers(0, 60), max_size=6),
)
def test_segment_fsums_are_safe_fsum_of_each_segment_and_of_all_bit_for_bit(values, cuts):
    import numpy as np

    from gradaudit.norms import safe_fsum, segment_fsums

    array = np.array(values, dtype=np.float64)
    starts = sorted({0, *(c for c in cuts if c < max(len(values), 1))})
    sums, total = segment_fsums(array, starts)
    expected = [safe_fsum(values[a:b]) for a, b in itertools.pairwise([*starts, len(values)])]

    def same(a: float, b: float) -> bool:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))

    assert len(sums) == len(expected) and all(same(a, b) for a, b in zip(sums, expected, strict=True))
    assert same(total, safe_fsum(values))


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 6),
            st.integers(0, 5),
            st.one_of(
                st.floats(0, 1e6),
                st.sampled_from((0.0, -0.0, 5e-324, 1e300, 1.7e308, math.inf, math.nan)),
            ),
            st.sampled_from((0, 0, 0, 1, 2, 4)),
        ),
        max_size=30,
    ),
    norm_type=st.sampled_from((1.0, 2.0, 3.0, math.inf)),
    sets=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=5, unique=True), max_size=8),
    replicated=st.booleans(),
)
def test_norms_primed_for_many_rank_sets_at_once_are_those_asked_one_by_one(
    rows, norm_type, sets, replicated
):
    """NormSet.prime (every rank set's norms in a few numpy passes, as the diagnosis asks them of each
    rank and group of a large step) gives norm() and num_layouts() bit for bit what asking gives."""
    from gradaudit.analysis.norm_input import NormSet

    rows = sorted(rows, key=lambda r: r[0])
    entries = dataclasses.replace(_entries(rows), replicated=replicated)
    asked = NormSet(entries, norm_type)
    primed = NormSet(entries, norm_type)
    sets = [*sets, sorted({r for r, *_ in rows}), *([r] for r, *_ in rows)]
    primed.prime(sets)
    for ranks in sets:
        for dedupe in (True, False):
            a, b = asked.norm(ranks, dedupe), primed.norm(ranks, dedupe)
            assert repr(a) == repr(b), (ranks, dedupe, a, b)
        assert asked.num_layouts(ranks) == primed.num_layouts(ranks)
