"""Process groups are decoded at C speed when they are plain rank lists; anything else goes through
the checks that name the bad entry, with the same result either way."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.dumpfile.schema import _decode_groups, _Reader
from gradaudit.errors import DumpFormatError

WORLD = 8

entries = st.one_of(
    st.integers(0, WORLD - 1),
    st.integers(-2, WORLD + 2),
    st.booleans(),
    st.floats(0, 4),
    st.text(max_size=2),
    st.none(),
)
rank_lists = st.one_of(
    st.lists(st.integers(0, WORLD - 1), max_size=6), st.lists(entries, max_size=6), entries
)
groups = st.dictionaries(st.sampled_from(["dp", "tp", "world"]), st.lists(rank_lists, max_size=4), max_size=3)


def _one_value_at_a_time(raw: dict) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The definition: every entry an int (not a bool) in [0, WORLD)."""
    decoded = {}
    for name, lists in raw.items():
        found = []
        for ranks in lists:
            if not isinstance(ranks, list):
                raise ValueError(name)
            for v in ranks:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < WORLD:
                    raise ValueError(name)
            found.append(tuple(ranks))
        decoded[name] = tuple(found)
    return decoded


@settings(max_examples=300, deadline=None)
@given(groups)
def test_decoded_groups_are_the_plain_rank_lists_and_anything_else_is_refused(raw):
    try:
        expected = _one_value_at_a_time(raw)
    except ValueError:
        expected = None
    try:
        decoded = _decode_groups(_Reader("rank_00000.safetensors"), raw, "topology.groups", WORLD)
    except DumpFormatError as exc:
        assert expected is None, exc
        assert "rank_00000.safetensors" in str(exc) and "topology.groups." in str(exc)
    else:
        assert decoded == expected
        assert all(type(r) is int for lists in decoded.values() for ranks in lists for r in ranks)
