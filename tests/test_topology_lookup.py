"""Topology.group_of answers from an index built once: the same rank list as a scan of the group's
lists in order (the first list holding the rank), for any layout of groups."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.model import Topology

rank_lists = st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=6).map(tuple), max_size=6)


def _scan(topology: Topology, name: str, rank: int) -> tuple[int, ...] | None:
    for ranks in topology.groups.get(name, ()):
        if rank in ranks:
            return ranks
    return None


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["dp", "tp", "pp", "world"]), rank_lists.map(tuple), max_size=4))
def test_group_of_is_the_first_listed_rank_list_holding_the_rank(groups):
    topology = Topology(groups=groups)
    for name in [*groups, "absent"]:
        for rank in range(17):
            assert topology.group_of(name, rank) == _scan(topology, name, rank)


def test_a_topology_that_was_asked_compares_and_pickles_as_one_that_was_not():
    asked, fresh = Topology(groups={"dp": ((0, 1), (2, 3))}), Topology(groups={"dp": ((0, 1), (2, 3))})
    assert asked.group_of("dp", 3) == (2, 3)
    assert asked == fresh
    assert pickle.loads(pickle.dumps(asked)).group_of("dp", 1) == (0, 1)
