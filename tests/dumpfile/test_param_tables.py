"""Ranks sharing a parameter table are looked at once; the result is that of looking at every rank."""

from __future__ import annotations

import random

import pytest

from gradaudit.dumpfile.dump import RankDump, as_columns
from gradaudit.dumpfile.loader import assemble_step
from gradaudit.model import Inconsistency, ParamInfo


def _every_rank(ranks: dict[int, RankDump]) -> list[Inconsistency]:
    """Shape and dtype disagreements, rank by rank (what the shared-table pass must equal)."""
    seen: dict[str, dict[int, tuple[tuple[int, ...], str]]] = {}
    for rank, dump in sorted(ranks.items()):
        for info in dump.params:
            seen.setdefault(info.name, {})[rank] = (tuple(info.global_shape), info.dtype)
    found = []
    for name in sorted(seen):
        by_rank = seen[name]
        for what, index in (("shape", 0), ("dtype", 1)):
            if len({v[index] for v in by_rank.values()}) > 1:
                found.append(
                    Inconsistency(
                        what=f"{what} of {name}", values={r: str(v[index]) for r, v in by_rank.items()}
                    )
                )
    return found


@pytest.mark.parametrize("seed", range(8))
def test_parameter_disagreements_and_the_step_parameters_equal_a_rank_by_rank_pass(seed):
    rng = random.Random(seed)
    tables = [
        tuple(
            ParamInfo(
                name=f"p{i}", global_shape=(rng.choice([2, 3]), 4), dtype=rng.choice(["float32", "bfloat16"])
            )
            for i in rng.sample(range(12), rng.randrange(1, 12))
        )
        for _ in range(3)
    ]
    world = 10
    ranks = {}
    for rank in range(world):
        table = rng.choice(tables)
        if rng.random() < 0.5:
            table = tuple(ParamInfo(name=p.name, global_shape=p.global_shape, dtype=p.dtype) for p in table)
        ranks[rank] = RankDump(
            path=f"rank_{rank}",
            rank=rank,
            world_size=world,
            step=1,
            params=table,
            pieces=as_columns(table, ()),
        )
    step = assemble_step("step", dict(ranks))
    expected = _every_rank(ranks)
    assert expected or seed  # the first seed gives some
    assert [i for i in step.inconsistencies if i.what.startswith(("shape of", "dtype of"))] == expected
    found: dict[str, ParamInfo] = {}
    for rank in sorted(ranks):
        for info in ranks[rank].params:
            found.setdefault(info.name, info)
    assert step.params == dict(sorted(found.items()))
