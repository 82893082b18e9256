"""gradaudit.guard in one process (no process group): what it checks, how often, and that a failure of
its own switches it off without breaking training."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import gradaudit
from gradaudit.errors import CaptureError
from gradaudit.live.guard import GuardAnomaly, GuardWarning
from gradaudit.live.trend import TREND_FILE

MAX_NORM = 0.1


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _steps(model, opt, count, *, clips=1):
    for _ in range(count):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        for _ in range(clips):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()


def _steps_with(model, opt, count, after_clip):
    """`count` steps, numbered from 1; `after_clip(step, norm)` runs between the clip and the
    optimizer step, which is taken only when it returns True."""
    for step in range(1, count + 1):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if after_clip(step, norm):
            opt.step()


def _trend(out):
    return [json.loads(line) for line in (out / TREND_FILE).read_text().splitlines()]


def test_every_n_checks_only_every_nth_step(tmp_path):
    model, opt = _setup()
    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, every=3) as guard:
        _steps(model, opt, 7)
    assert [line["step"] for line in _trend(tmp_path)] == [3, 6]
    assert guard.anomalies == [] and not guard.active
    assert not getattr(torch.nn.utils.clip_grad_norm_, "__gradaudit_intercepted__", False)  # removed


def test_two_clip_calls_in_one_step_raise_ga501_with_the_step(tmp_path):
    model, opt = _setup()
    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, on_anomaly="raise"):
        _steps(model, opt, 1)
        with pytest.raises(GuardAnomaly, match=r"step 2: GA501") as raised:
            _steps(model, opt, 1, clips=2)
    assert raised.value.step == 2 and "GA501" in raised.value.codes
    assert not getattr(torch.nn.utils.clip_grad_norm_, "__gradaudit_intercepted__", False)  # removed


def test_a_failure_inside_the_guard_warns_and_three_failed_steps_in_a_row_switch_it_off(tmp_path):
    model, opt = _setup()
    guard = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path)

    def broken():
        raise RuntimeError("summary exploded")

    guard._summary.measure = broken  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(model, opt, 2)  # training goes on, the steps unchecked
        assert guard.active and guard.anomalies == []
        _steps(model, opt, 2)
    ours = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert len(ours) == 3, ours
    assert "could not measure step 1" in ours[0] and "summary exploded" in ours[0]
    assert "step 1 is not checked" in ours[1]
    assert "3 steps in a row" in ours[2] and "the guard is off" in ours[2]
    assert not guard.active and not (tmp_path / TREND_FILE).exists()
    assert not getattr(torch.nn.utils.clip_grad_norm_, "__gradaudit_intercepted__", False)  # switched off


def test_one_failed_step_is_left_unchecked_and_the_next_is_checked_as_before(tmp_path):
    model, opt = _setup()
    guard = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, capture_next=False)
    measure = guard._summary.measure

    def broken_at_step_2():
        if guard.step == 2:
            raise RuntimeError("once")
        return measure()

    guard._summary.measure = broken_at_step_2  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        _steps(model, opt, 2)
        _steps(model, opt, 2, clips=2)  # GA501 at steps 3 and 4: still found after the failure
        assert guard.active
        guard.remove()
    assert [line["step"] for line in _trend(tmp_path)] == [1, 3, 4]
    assert [step for step, _ in guard.anomalies] == [3, 4]


def test_the_guard_refuses_a_call_without_optimizer_or_out_dir(tmp_path):
    model, _ = _setup()
    with pytest.raises(CaptureError, match="optimizer="):
        gradaudit.guard(model, max_norm=MAX_NORM, out_dir=tmp_path)
    with pytest.raises(CaptureError, match="on_anomaly"):
        gradaudit.guard(model, max_norm=MAX_NORM, optimizer=_setup()[1], out_dir=tmp_path, on_anomaly="log")


def test_a_step_the_scaler_skips_is_written_as_skipped_and_the_scaler_is_left_as_it_was(tmp_path):
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GuardWarning)
        with gradaudit.guard(
            model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, scaler=scaler
        ) as guard:
            assert "step" in vars(scaler)  # the guard sees scaler.step end a step the optimizer never took
            for loss_factor in (1.0, float("inf"), 1.0):
                opt.zero_grad()
                scaler.scale(model(torch.randn(4, 8)).pow(2).sum() * loss_factor).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                scaler.step(opt)
                scaler.update()
    assert [(line["step"], line["verdict"]) for line in _trend(tmp_path)] == [
        (1, "ok"),
        (2, "skipped"),
        (3, "ok"),
    ]
    assert guard.anomalies == []
    assert "step" not in vars(scaler)  # removed with the guard: the class's own step again


def test_the_guard_keeps_the_loss_scale_on_its_device_and_checks_the_clip_against_it(tmp_path, monkeypatch):
    # GradScaler.get_scale waits for the device: checked steps leave it unread, and clipping before
    # unscale_ is still caught (the full capture that follows an anomaly reads it, for its dump)
    model, opt = _setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    reads: list[float] = []
    reads_by_step = []
    get_scale = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(
        torch.amp.GradScaler, "get_scale", lambda self: reads.append(get_scale(self)) or reads[-1]
    )
    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, scaler=scaler) as guard:
        for unscale_first in (True, True, False):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 8)).pow(2).sum()).backward()
            if unscale_first:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
            reads_by_step.append(len(reads))
        lines = _trend(tmp_path)
    assert reads_by_step[:2] == [0, 0]
    assert [(line["step"], line["verdict"]) for line in lines] == [(1, "ok"), (2, "ok"), (3, "anomaly")]
    assert [step for step, _ in guard.anomalies] == [3]


def test_pieces_that_ranks_hold_alike_without_a_replica_group_are_one_group_over_their_holders():
    from gradaudit.live.guard import _ownership_keys
    from gradaudit.model import FlatRange

    whole, half, other = (
        (FlatRange(start=0, stop=4),),
        (FlatRange(start=0, stop=2),),
        (FlatRange(start=2, stop=4),),
    )
    every_rank = [  # dense: whole on both ranks, no replica group; fc: sharded; head: empty on rank 1
        [
            ("dense", whole, "sharded", "float32"),
            ("fc", half, "sharded", "float32"),
            ("head", None, "sharded", "float32"),
        ],
        [
            ("dense", whole, "sharded", "float32"),
            ("fc", other, "sharded", "float32"),
            ("head", None, "sharded", "float32"),
        ],
        [("dp", whole, "world", "float32")],
    ]
    keys, added = _ownership_keys(every_rank)
    assert keys == [["ranks 0,1", "sharded", "sharded"], ["ranks 0,1", "sharded", "sharded"], ["world"]]
    assert added == {"ranks 0,1": ((0, 1),)}


def test_a_step_clipped_per_micro_batch_shows_its_first_clips_norms_in_the_trend_the_warning_and_the_table(
    tmp_path,
):
    from gradaudit.audit import AuditOptions, audit_folder
    from gradaudit.render.charts import trend_points
    from gradaudit.render.json import render_multi as json_multi
    from gradaudit.render.markdown import render_multi as markdown_multi
    from gradaudit.render.steps import step_rows
    from gradaudit.render.terminal import render_multi

    model, opt = _setup()
    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
        model(torch.randn(4, 8)).pow(2).sum().backward()
        first = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        reported = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))  # micro-batch 1
        model(torch.randn(4, 8)).pow(2).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GuardWarning)
            last = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            opt.step()
        logged = guard.last.metrics() if guard.last is not None else {}
        _steps(model, opt, 1)  # captured in full: a second step of the run folder
    (line,) = _trend(tmp_path)
    assert guard.anomalies == [(1, ("GA501",))] and line["codes"] == ["GA501"] and line["clip_calls"] == 2
    assert first > 10 * MAX_NORM and line["true_norm"] == pytest.approx(first, rel=1e-6)
    # the first call's reported norm beside its true norm (ratio 1), not the last call's over the first's
    assert (
        line["reported_norm"] == pytest.approx(reported, rel=1e-6) and abs(last - reported) > 0.1 * reported
    )
    # logged: the last call's reported norm over the true norm (the first call's ratio would read 1)
    assert logged["gradaudit/reported_over_true"] == pytest.approx(last / line["true_norm"], rel=1e-5)
    assert logged["gradaudit/anomaly"] == 1.0
    (warned,) = [str(w.message) for w in caught if "GA501" in str(w.message)]
    assert f"true norm {line['true_norm']:.6g}, reported {reported:.6g}" in warned
    assert f"applied by the last of 2 clip calls {line['min_coef']:.6g}.." in warned
    multi = audit_folder(tmp_path, AuditOptions())
    (row,) = [row for row in step_rows(multi)[0] if row.steps == (1,)]
    # the run table shows the trend's number, not the report's norm before the last call
    assert row.global_norm == (line["true_norm"], line["true_norm"]) and row.clip_calls == 2
    assert row.ratio[0] == pytest.approx(line["reported_norm"] / line["true_norm"]) == pytest.approx(1.0)
    assert row.expected_clip_coef[0] == pytest.approx(MAX_NORM / (first + 1e-6))  # at that moment too
    assert line["expected_coef"] == row.expected_clip_coef[0]  # the trend file's coefficient too
    (summary,) = [s for s in json.loads(json_multi(multi))["summary"] if s["step"] == 1]
    (point,) = [p for p in trend_points(multi, {1}) if p.step == 1]  # the Markdown chart's
    assert summary["global_norm"] == point.true_norm == line["true_norm"]
    assert summary["reported_norm"] == point.reported_norm == line["reported_norm"]
    assert summary["expected_clip_coef"] == row.expected_clip_coef[0]
    (report,) = [r for r in multi.steps if r.step == 1]
    assert report.global_norm is not None and abs(report.global_norm - first) > 0.1 * first
    note = "step 1: reported norm, true norm and expected coef at the first of its 2 clip calls"
    assert note in render_multi(multi, width=200) and note in markdown_multi(multi)


def test_line_of_a_step_reads_its_pending_verdict_and_never_gives_another_steps_line(tmp_path):
    model, opt = _setup()
    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, late=True) as guard:
        _steps(model, opt, 1)
        assert guard.last is None  # late: read at the next step, or when asked for it
        line = guard.line_of(1)
        assert line is not None and line.step == 1 and line.ok and guard.line_of(2) is None
        _steps(model, opt, 1)
        assert guard.line_of(2) is not None and guard.line_of(1) is None  # the latest line is step 2's


def test_max_dumps_and_cooldown_bound_the_dumps_of_a_mistake_that_persists_and_its_repeats_are_folded(
    tmp_path,
):
    model, opt = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradaudit.guard(
            model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, max_dumps=2, cooldown=3
        ) as guard:
            _steps(model, opt, 10, clips=2)  # GA501 on every step
    # a dump arms a full capture of the next step (2, 5), checked offline instead of live
    checked = [1, 3, 4, 6, 7, 8, 9, 10]
    assert guard.anomalies == [(step, ("GA501",)) for step in checked]
    assert [(line["step"], line["verdict"]) for line in _trend(tmp_path)] == [(s, "anomaly") for s in checked]
    # step 3 is within the cooldown of step 1's dump, step 6 past max_dumps
    assert [path.parent.name for path in guard.dumps] == ["step_1", "step_4"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_4"]
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["step_2", "step_5"]
    messages = [str(w.message) for w in caught if "gradaudit guard" in str(w.message)]
    assert [m.split(":", 1)[1].strip() for m in messages] == [
        messages[0].split(":", 1)[1].strip(),  # step 1, with its dump
        "GA501 again at step 3",
        messages[2].split(":", 1)[1].strip(),  # step 4, with its dump
        "GA501 again at steps 6-10",
        f"8 anomalous steps of 8 checked: GA501 at steps 1, 3-4, 6-10; gradaudit check {tmp_path}",
    ]
    dumped = [m for m in messages if "its dump: gradaudit check" in m]
    assert [m.split(":")[1].strip() for m in dumped] == ["step 1", "step 4"]


def test_a_framework_callback_clips_to_its_own_max_norm_else_the_frameworks_and_names_the_setting(tmp_path):
    from gradaudit.live.guard import GuardCallbackOptions

    model, opt = _setup()
    with pytest.raises(CaptureError, match=r"set Trainer\(gradient_clip_val=\.\.\.\) or pass GuardCallback"):
        GuardCallbackOptions(tmp_path).attach(model, opt, "Trainer(gradient_clip_val=...)", None)
    options = GuardCallbackOptions(tmp_path, every=2, first_step=7)  # the user's keywords win
    with options.attach(model, opt, "-", 0.5, first_step=3) as guard:
        assert guard is options.guard and guard.max_norm == 0.5 and guard.every == 2 and guard.step == 7
    with GuardCallbackOptions(tmp_path, max_norm=0.25).attach(model, opt, "-", 0.5) as guard:
        assert guard.max_norm == 0.25


def test_steps_between_pause_and_resume_are_not_checked_and_the_step_count_goes_on(tmp_path):
    model, opt = _setup()
    with gradaudit.guard(
        model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path, on_anomaly="raise"
    ) as guard:
        _steps(model, opt, 2)
        guard.pause()
        _steps(model, opt, 2, clips=2)  # GA501 at a checked step; paused, nothing is said
        guard.resume()
        _steps(model, opt, 1)
        with pytest.raises(GuardAnomaly, match=r"step 6: GA501"):
            _steps(model, opt, 1, clips=2)
    assert [line["step"] for line in _trend(tmp_path)] == [1, 2, 5, 6]


def test_a_second_guard_of_the_same_optimizer_is_refused_with_one_line_naming_the_first(tmp_path):
    model, opt = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path / "first")
        second = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path / "second")
        _steps(model, opt, 3)
    ours = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert len(ours) == 1 and "already attached" in ours[0] and str(tmp_path / "first") in ours[0]
    assert first.active and not second.active
    assert first.anomalies == [] and [line["step"] for line in _trend(tmp_path / "first")] == [1, 2, 3]
    first.remove()
    third = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path / "third")
    assert third.active  # once the first is removed, another may be attached
    third.remove()


@pytest.mark.parametrize("change", ["unfreeze_and_add_group", "swap_module", "load_state_dict_assign"])
def test_parameters_that_change_mid_run_are_followed_without_a_false_finding(tmp_path, change):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if change == "unfreeze_and_add_group":
        model[2].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
            _steps(model, opt, 3)
            if change == "unfreeze_and_add_group":
                model[2].requires_grad_(True)
                opt.add_param_group({"params": list(model[2].parameters())})
            elif change == "swap_module":
                model[0] = torch.nn.Linear(8, 8)
                opt.add_param_group({"params": list(model[0].parameters())})
            else:
                model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
                opt.add_param_group({"params": list(model.parameters())})
            _steps(model, opt, 10)
    said = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert guard.anomalies == [], said
    assert len(said) == 1 and "step 4 is not checked: the trained parameters changed" in said[0]
    assert [line["step"] for line in _trend(tmp_path)] == [1, 2, 3, *range(5, 14)]
    true_norms = [line["true_norm"] for line in _trend(tmp_path)]
    assert all(t is not None and t > MAX_NORM for t in true_norms)


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_a_block_frozen_or_unfrozen_under_the_same_optimizer_gives_no_false_finding(tmp_path, change):
    # The optimizer holds every parameter from the start: only requires_grad changes at step 4. An
    # unfrozen block is new to the ownership (inferred again, that step unchecked); a frozen one's
    # gradient stops coming, which the checks read as an absent gradient, as the clip does.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model[2].requires_grad_(change == "freeze")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
            _steps(model, opt, 3)
            model[2].requires_grad_(change == "unfreeze")
            _steps(model, opt, 10)
    said = [str(w.message) for w in caught if issubclass(w.category, GuardWarning)]
    assert guard.anomalies == [], said
    unchecked = [4] if change == "unfreeze" else []
    assert len(said) == len(unchecked), said
    assert all("step 4 is not checked: the trained parameters changed" in text for text in said)
    lines = _trend(tmp_path)
    assert [line["step"] for line in lines] == [s for s in range(1, 14) if s not in unchecked]
    # the true norm the guard checked is the clip's own: with the head or without it
    assert all(line["true_norm"] == pytest.approx(line["reported_norm"], rel=1e-6) for line in lines)


def test_a_restart_into_the_same_out_dir_appends_the_trend_after_a_cut_line_and_writes_beside_earlier_dumps(
    tmp_path,
):
    for attempt in (1, 2):
        model, opt = _setup()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
                _steps(model, opt, 1)
                _steps(model, opt, 1, clips=2)  # GA501 at step 2, dumped
        if attempt == 1:
            with open(tmp_path / TREND_FILE, "a", encoding="utf-8") as trend:
                trend.write('{"step": 3, "true_n')  # the first attempt ran out of disk mid-line
    assert [line["step"] for line in _trend(tmp_path)] == [1, 2, 1, 2]
    assert (tmp_path / "step_2").is_dir() and (tmp_path / "attempt_2" / "step_2").is_dir()
    assert [p.relative_to(tmp_path).parts[0] for p in guard.dumps] == ["attempt_2"]
    from gradaudit.audit import run_step_dirs

    assert [d.relative_to(tmp_path).as_posix() for d in run_step_dirs(tmp_path)] == [
        "step_2",
        "attempt_2/step_2",
    ]


def test_a_clip_call_with_max_norm_inf_reads_the_norm_and_is_no_second_clip_call(tmp_path):
    model, opt = _setup()
    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).sum().backward()
            logged = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # to log the norm
            clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            assert logged == pytest.approx(clipped)
            opt.step()
    assert guard.anomalies == []
    assert [line["verdict"] for line in _trend(tmp_path)] == ["ok", "ok", "ok"]


def test_a_max_norm_schedule_given_as_a_function_of_the_step_is_followed(tmp_path):
    model, opt = _setup()

    def schedule(step):
        return MAX_NORM * min(1.0, step / 3)  # warm-up over three steps

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradaudit.guard(model, max_norm=schedule, optimizer=opt, out_dir=tmp_path) as guard:
            for step in range(1, 6):
                opt.zero_grad()
                model(torch.randn(4, 8)).pow(2).sum().backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), schedule(step))
                opt.step()
    assert guard.anomalies == []
    assert [w for w in caught if issubclass(w.category, GuardWarning)] == []
    expected = [line["expected_coef"] * line["true_norm"] for line in _trend(tmp_path)]
    assert expected == pytest.approx([schedule(s) for s in range(1, 6)], rel=1e-5)


def test_a_step_the_training_discards_after_clipping_is_not_counted_toward_the_next(tmp_path):
    model, opt = _setup()

    def skip_batch_two(step, norm):
        if step == 2 or not torch.isfinite(norm):  # the user's own "skip this batch"
            opt.zero_grad()
            return False
        return True

    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
        _steps_with(model, opt, 4, skip_batch_two)
    assert guard.anomalies == []  # before: GA501 at the step after the discarded one
    assert [line["step"] for line in _trend(tmp_path)] == [1, 2, 3]


@pytest.mark.parametrize("recorded_by", ["interception", "audit.clip", "guard.clip"])
def test_a_guard_and_an_audit_of_the_same_step_both_record_its_clip_call(tmp_path, recorded_by):
    """Whichever records the call itself (an integration's `audit.clip`, a loop's `guard.clip`), the
    other sees it too: no false GA503 (a guard that saw no clip call measures after the clip)."""
    model, opt = _setup()
    clip = torch.nn.utils.clip_grad_norm_
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path / "guard") as guard:
            _steps(model, opt, 1)
            with gradaudit.audit_step(
                model, tmp_path / "dumps", step=2, max_norm=MAX_NORM, optimizer=opt
            ) as audit:
                if recorded_by == "interception":
                    _steps(model, opt, 1)
                else:
                    recorder = audit if recorded_by == "audit.clip" else guard
                    opt.zero_grad()
                    model(torch.randn(4, 8)).pow(2).sum().backward()
                    recorder.clip(clip, model.parameters(), MAX_NORM)
                    opt.step()
            _steps(model, opt, 1)
    assert guard.anomalies == [], [str(w.message) for w in caught]  # before: GA503 at step 2
    assert [line["verdict"] for line in _trend(tmp_path / "guard")] == ["ok", "ok", "ok"]
    from gradaudit.audit import audit_folder
    from gradaudit.checks.base import AuditOptions

    report = audit_folder(tmp_path / "dumps" / "step_2", AuditOptions())
    assert [f.code for f in report.findings if f.severity.name == "ERROR"] == []


def test_a_gradient_freed_between_the_clip_and_the_step_leaves_the_coefficient_unmeasured_not_wrong(tmp_path):
    model, opt = _setup()

    def free_at_three(step, _):
        if step == 3:
            model[0].weight.grad = None  # the largest piece, sampled: the optimizer skips it
        return True

    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
        _steps_with(model, opt, 4, free_at_three)
    lines = {line["step"]: line for line in _trend(tmp_path)}
    assert guard.anomalies == [] and sorted(lines) == [1, 2, 3, 4]
    assert all(line["verdict"] == "ok" for line in lines.values())
    assert lines[3]["min_coef"] is None and lines[3]["max_coef"] is None
    assert all(lines[step]["min_coef"] == pytest.approx(lines[step]["expected_coef"]) for step in (1, 2, 4))
