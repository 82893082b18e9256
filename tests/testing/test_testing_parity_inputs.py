"""check_clip_parity's judgement of the user's arguments and inputs, without spawning ranks."""

from __future__ import annotations

import pytest
import torch

from gradaudit.errors import UsageError
from gradaudit.testing import NotSendableError
from gradaudit.testing.parity import _input_problems, check_clip_parity
from gradaudit.testing.parity_ranks import ReferenceFacts, concat_batches, data_representatives


def build():
    return torch.nn.Linear(2, 2)


def make_batch(rank, step):
    return torch.zeros(1, 2)


def step(model, batch, max_norm):
    return None


CALLABLES = {"build": build, "parallelize": lambda model, mesh: model, "make_batch": make_batch, "step": step}


def facts(**changes):
    base = {"data_ranks": (0, 1), "identical_steps": (), "mismatched": (), "build_differs": False}
    return ReferenceFacts(**{**base, **changes})


def test_each_rank_is_represented_by_the_rank_of_its_data_parallel_coordinate():
    assert data_representatives((("dp", 4),), ("dp",)) == [0, 1, 2, 3]
    assert data_representatives((("dp", 2), ("tp", 2)), ("dp",)) == [0, 0, 2, 2]
    assert data_representatives((("tp", 2), ("dp", 2)), ("dp",)) == [0, 1, 0, 1]
    assert data_representatives((("tp", 2),), ()) == [0, 0]


def test_the_global_batch_joins_the_ranks_batches_leaf_by_leaf_in_rank_order():
    joined = concat_batches([{"x": torch.tensor([[1.0]]), "n": 3}, {"x": torch.tensor([[2.0]]), "n": 3}])
    assert joined["x"].tolist() == [[1.0], [2.0]] and joined["n"] == 3
    pair = concat_batches([(torch.tensor([1]), torch.tensor([5])), (torch.tensor([2]), torch.tensor([6]))])
    assert [t.tolist() for t in pair] == [[1, 2], [5, 6]]
    with pytest.raises(UsageError, match="cannot be joined"):
        concat_batches([1, 2])


def test_identical_inputs_on_the_data_parallel_ranks_fail_with_their_own_message_unless_allowed():
    (problem,) = _input_problems(facts(identical_steps=(1, 2)), rank_specific_inputs=True)
    assert "data-parallel ranks 0, 1 identical batches on step 1, 2" in problem
    assert "rank_specific_inputs=False" in problem
    assert _input_problems(facts(identical_steps=(1, 2)), rank_specific_inputs=False) == []


def test_an_unseeded_build_and_a_tensor_parallel_group_fed_different_batches_are_named():
    problems = _input_problems(facts(build_differs=True, mismatched=((1, 3, 2),)), rank_specific_inputs=True)
    assert "build() gave different weights on two calls" in problems[0]
    assert "rank 3 a different batch from rank 2 on step 1" in problems[1]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": 1}, "steps must be an int of at least 2"),
        ({"max_norm": 0.0}, "max_norm must be a positive finite number"),
        ({"world_size": 4, "mesh": {"dp": 3}}, "holds 3 ranks but world_size is 4"),
        ({"world_size": 2, "mesh": {"dp": 2}, "data_axes": ["tp"]}, "data_axes \\['tp'\\] are not axes"),
        ({"fail_on": "info"}, "fail_on must be 'error' or 'warning'"),
    ],
)
def test_arguments_that_cannot_make_a_parity_check_are_refused_before_any_rank_starts(changes, message):
    with pytest.raises(UsageError, match=message):
        check_clip_parity(**{**CALLABLES, "parallelize": build, **changes})


def test_a_lambda_is_refused_naming_the_argument_and_where_to_define_it():
    with pytest.raises(NotSendableError, match="parallelize=.*<lambda>.*define it at module level"):
        check_clip_parity(**CALLABLES, world_size=2)


def test_an_out_dir_that_already_holds_dumps_is_never_written_over(tmp_path):
    (tmp_path / "sharded").mkdir()
    with pytest.raises(UsageError, match="sharded already exists and dumps are never overwritten"):
        check_clip_parity(**{**CALLABLES, "parallelize": build}, world_size=2, out_dir=tmp_path)
