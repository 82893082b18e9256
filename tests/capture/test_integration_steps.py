"""Which steps the framework integrations audit, and their argument errors (no framework needed)."""

from __future__ import annotations

import pytest

from gradaudit.capture.steps import select_steps
from gradaudit.errors import CaptureError


def test_no_selection_audits_the_first_optimizer_step_only():
    selection = select_steps(None, None)
    assert selection.wants(1) and not selection.wants(2)


def test_every_n_audits_each_nth_step_and_a_list_exactly_its_steps():
    assert [s for s in range(1, 10) if select_steps(None, 3).wants(s)] == [3, 6, 9]
    assert [s for s in range(1, 10) if select_steps([2, 7], None).wants(s)] == [2, 7]
    assert select_steps(5, None).wants(5)


@pytest.mark.parametrize(
    ("steps", "every", "message"),
    [
        ([1], 2, "not both"),
        ([0], None, "counted from 1"),
        (None, 0, "positive int"),
        (["1"], None, "counted from 1"),
    ],
)
def test_bad_selections_are_refused_saying_what_to_pass(steps, every, message):
    with pytest.raises(CaptureError, match=message):
        select_steps(steps, every)
