"""One odd parameter must not poison a rank: sparse gradients are left out and named, complex ones
are captured as their real pairs."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from integration.launcher import run_ranks

import gradaudit
from gradaudit.audit import audit_step_dir as _audit
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile import load_step
from gradaudit.model import Box, FlatRange
from gradaudit.warn import CaptureWarning, forget_warnings

from .cli import run_cli
from .corpus import edit_metadata, rank_path, write_valid_step
from .odd_params_workers import OddModel, ddp_step, one_step


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    forget_warnings()


def audit_step_dir(step_dir: Path):
    return _audit(step_dir, AuditOptions())


def _not_captured(step_dir: Path) -> dict[int, dict[str, str]]:
    step = load_step(step_dir)
    return {rank: {p.name: p.reason for p in step.ranks[rank].not_captured} for rank in step.ranks_present}


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_a_sparse_embedding_is_left_out_with_one_warning_and_the_rest_of_the_rank_is_audited(tmp_path, mode):
    torch.manual_seed(0)
    model = OddModel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, norm = one_step(model, str(tmp_path), torch.tensor([1, 2, 3]), mode=mode)
    messages = [str(w.message) for w in caught if issubclass(w.category, CaptureWarning)]
    assert len(messages) == 1 and "'emb.weight'" in messages[0] and "sparse" in messages[0]
    step_dir = Path(path).parent
    assert _not_captured(step_dir) == {
        0: {"emb.weight": "sparse gradient (sparse_coo); gradaudit reads dense gradients"}
    }
    report = audit_step_dir(step_dir)
    assert abs(report.global_norm - norm) <= 1e-6 * norm
    assert "GA104" in {n.code for n in report.not_checked}


def test_a_complex_gradient_is_captured_as_real_pairs_whose_norm_is_the_one_clip_grad_norm_uses(tmp_path):
    torch.manual_seed(0)
    with pytest.warns(CaptureWarning, match="emb.weight"):
        path, norm = one_step(OddModel(), str(tmp_path), torch.tensor([4]))
    step = load_step(Path(path).parent)
    info = step.params["phase"]
    assert (info.global_shape, info.dtype) == ((3, 2, 2), "float32")
    piece = next(p for p in step.ranks[0].pieces if p.param == "phase")
    assert piece.regions == (Box(offsets=(0, 0, 0), shape=(3, 2, 2)),)
    report = audit_step_dir(Path(path).parent)
    assert abs(report.global_norm - norm) <= 1e-6 * norm


def test_a_complex_gradient_under_another_norm_is_left_out_with_the_reason(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    model.register_parameter("phase", torch.nn.Parameter(torch.ones(2, dtype=torch.complex64)))
    with pytest.warns(CaptureWarning, match="'phase'.*norm_type 1"):
        with gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0, norm_type=1.0) as audit:
            (model(torch.ones(2)).sum() + model.phase.abs().sum()).backward()
    reasons = _not_captured(audit.path.parent)[0]
    assert list(reasons) == ["phase"] and "only its 2-norm" in reasons["phase"]


def test_a_flat_range_of_a_complex_parameter_covers_twice_the_real_elements():
    from gradaudit.capture.supported import _with_pairs

    assert _with_pairs(FlatRange(start=3, stop=5)) == FlatRange(start=6, stop=10)


def test_the_report_names_the_parameters_left_out_under_not_checked(tmp_path, capsys):
    torch.manual_seed(0)
    with pytest.warns(CaptureWarning, match="emb.weight"):
        path, _ = one_step(OddModel(), str(tmp_path), torch.tensor([1, 2]))
    outcome = run_cli(capsys, "check", str(Path(path).parent), "--format", "markdown")
    assert outcome.code == 0, outcome.stderr
    assert "GA104" in outcome.stdout and "emb.weight" in outcome.stdout


@pytest.mark.integration
def test_under_ddp_on_two_ranks_a_sparse_embedding_and_a_complex_parameter_leave_every_rank_audited(tmp_path):
    results = run_ranks(ddp_step, 2, (str(tmp_path),), timeout_s=120)
    step_dir = Path(results[0][0]).parent
    assert _not_captured(step_dir) == {
        rank: {"emb.weight": "sparse gradient (sparse_coo); gradaudit reads dense gradients"}
        for rank in (0, 1)
    }
    report = audit_step_dir(step_dir)
    norm = results[0][1]
    assert abs(report.global_norm - norm) <= 1e-6 * norm and results[1][1] == norm
    assert not {f.code for f in report.findings if f.severity.value == "error"}
    assert load_step(step_dir).params["phase"].global_shape == (3, 2, 2)


def test_a_step_whose_ranks_captured_every_parameter_leaves_ga104_decided(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    assert "GA104" not in {n.code for n in audit_step_dir(step_dir).not_checked}


def test_parameters_listed_as_not_captured_are_named_with_their_ranks_under_not_checked(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    for rank in (0, 1):
        edit_metadata(
            rank_path(step_dir, rank),
            lambda doc: doc.__setitem__(
                "not_captured", [{"name": "emb.weight", "reason": "sparse gradient"}]
            ),
        )
    reason = {n.code: n.reason for n in audit_step_dir(step_dir).not_checked}["GA104"]
    assert "emb.weight on ranks 0-1: sparse gradient" in reason


@pytest.mark.parametrize("entry", [{"reason": "sparse"}, {"name": 3, "reason": "x"}, "emb.weight"])
def test_a_malformed_not_captured_entry_is_refused_with_one_line(tmp_path, capsys, entry):
    step_dir = write_valid_step(tmp_path / "step_7")
    edit_metadata(rank_path(step_dir, 0), lambda doc: doc.__setitem__("not_captured", [entry]))
    outcome = run_cli(capsys, "check", str(step_dir))
    assert outcome.code == 2 and len(outcome.stderr_lines) == 1 and "not_captured[0]" in outcome.stderr
