"""One clip call is recorded in one form by audit_step and by the guard: what it was passed (or its
defaults), what it returned, and what the recorder measured around it, read into the dump's ClipCall."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gradaudit.capture.arguments import CallRecord, norm_results
from gradaudit.model import ClipCall


def test_a_call_record_takes_the_arguments_passed_and_the_defaults_not_passed():
    params = [torch.nn.Parameter(torch.ones(4))]
    params[0].grad = torch.full((4,), 3.0)
    result = torch.nn.utils.clip_grad_norm_(params, 1.0)
    record = CallRecord.of(
        torch.nn.utils.clip_grad_norm_, (params, 1.0), {}, norm_results(result), unscaled=True, loss_scale=8.0
    )
    assert (record.max_norm, record.norm_type) == (1.0, 2.0)
    assert record.clip_call() == ClipCall(
        reported_norm=pytest.approx(6.0), max_norm=1.0, norm_type=2.0, unscaled=True, loss_scale=8.0
    )
    passed = CallRecord.of(
        torch.nn.utils.clip_grad_norm_, (params,), {"max_norm": 0.5, "norm_type": "inf"}, None
    )
    assert (passed.max_norm, passed.norm_type, passed.reported) == (0.5, "inf", None)
    assert passed.clip_call().norm_type == math.inf


def test_a_call_record_of_a_function_naming_no_max_norm_and_its_guard_fields():
    def own_clip(grads, limit):
        return torch.tensor(2.0)

    record = CallRecord.of(
        own_clip, ([], 1.0), {}, (torch.tensor(2.0), None), terms=torch.ones(2), sampled=(1,)
    )
    assert (record.max_norm, record.norm_type, record.coef, record.sampled) == (None, None, None, (1,))
    assert record.clip_call() == ClipCall(reported_norm=2.0)
    applied = dataclasses.replace(record, coef=0.5)
    assert applied.coef == 0.5 and record.coef is None and applied.terms is record.terms
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.coef = 0.5
