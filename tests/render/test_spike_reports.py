"""A spike of the true norm in the reports: `gradaudit check` of a step the guard dumped at a spike
shows the parameters holding most of Σg² (each element once) beside each rank's share, and a guarded
run's trend marks its spike steps, in every format; a report without a spike keeps its bytes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest
import torch
from builders import box, check, clip, tensor_with_norm, whole, write_step
from goldens import RENDERER_GOLDENS, assert_golden
from live.trends import clipped_line, write_trend

from gradaudit.audit import audit_folder
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile.loader import load_rank_file
from gradaudit.dumpfile.writer import write_rank_file
from gradaudit.errors import StepFolderError
from gradaudit.live.spike import SPIKE_TRIGGER
from gradaudit.live.trend import TREND_FILE, TrendLine, read_trend
from gradaudit.model import Topology
from gradaudit.render import json as json_render
from gradaudit.render import markdown as markdown_render
from gradaudit.render import terminal as terminal_render
from gradaudit.report.model import Finding, MultiStepReport, Severity
from gradaudit.version import __version__

SHARDS = {"layers.11.mlp.w2": (6.0, 8.0), "layers.10.mlp.w2": (5.0, 5.0), "embed.weight": (4.0, 2.0)}
"""Each parameter split by rows over ranks 0 and 1: the norm of each rank's half. With norm.weight
(norm √30, whole on both ranks) Σg² is 100 + 50 + 20 + 30 = 200."""
EXPECTED = (
    ("layers.11.mlp.w2", 0.5),
    ("layers.10.mlp.w2", 0.25),
    ("norm.weight", 0.15),
    ("embed.weight", 0.1),
)
NOTE = "true norm 14.1421 is 12.5x the median 1.13137 of the last 20 checked steps"
SPIKE_STEP = 7


def _grads() -> dict[int, dict[str, torch.Tensor]]:
    def grad(norm: float, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        return tensor_with_norm(norm, shape, seed=seed, dtype=torch.float64)

    replica = grad(math.sqrt(30.0), (4,), seed=99)
    return {
        rank: {
            name: grad(norms[rank], (4, 4), seed=10 * rank + i)
            for i, (name, norms) in enumerate(SHARDS.items())
        }
        | {"norm.weight": replica}
        for rank in (0, 1)
    }


def write_spike_dump(directory: Path, *, trigger: str | None = SPIKE_TRIGGER, nan: bool = False) -> Path:
    """A 2-rank stats dump of step 7, clipped right at max_norm 1, as the guard writes at a spike: its
    trigger and note set, versions fixed so that the reports read alike everywhere."""
    grads = _grads()
    if nan:
        grads[1]["embed.weight"][0, 0] = math.nan
    pieces = {
        rank: [
            *(
                box(name, (4 * rank, 0), grad=g, stats_only=True)
                for name, g in held.items()
                if name in SHARDS
            ),
            whole("norm.weight", grad=held["norm.weight"], replica_group="dp", stats_only=True),
        ]
        for rank, held in grads.items()
    }
    norm = math.sqrt(200.0)
    write_step(
        directory,
        world_size=2,
        params=dict.fromkeys(SHARDS, (8, 4)) | {"norm.weight": (4,)},
        pieces=pieces,
        clips=clip(1.0, reported_norm=norm, clip_coef=1.0 / (norm + 1e-6)),
        topology=Topology(groups={"dp": ((0, 1),)}),
        step=SPIKE_STEP,
    )
    for file in sorted(directory.glob("rank_*.safetensors")):
        dump = load_rank_file(file)
        file.unlink()
        marked = dataclasses.replace(
            dump,
            torch_version="2.6.0",
            gradaudit_version=__version__,
            trigger=trigger,
            trigger_note=None if trigger is None else NOTE,
        )
        write_rank_file(directory, marked, {})
    return directory


@pytest.fixture
def spike_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return write_spike_dump(Path("audit") / f"step_{SPIKE_STEP}")


SINGLE = {
    "terminal.txt": lambda report: terminal_render.render_report(report, width=100),
    "md": markdown_render.render_report,
    "json": json_render.render_report,
}
MULTI = {
    "terminal.txt": lambda multi: terminal_render.render_multi(multi, width=100),
    "md": markdown_render.render_multi,
    "json": json_render.render_multi,
}


@pytest.mark.parametrize("suffix", sorted(SINGLE))
def test_a_spike_dump_renders_the_parameters_shares_of_the_squared_norm_as_in_the_golden_file(
    request, spike_dump, suffix
):
    assert_golden(request, RENDERER_GOLDENS / f"spike_step.{suffix}", SINGLE[suffix](check(spike_dump)))


def test_the_shares_count_each_element_once_as_an_unsharded_computation_does(spike_dump):
    shares = check(spike_dump).sum_sq_shares
    assert shares is not None
    grads = _grads()
    unsharded = {name: sum(float(grads[r][name].pow(2).sum()) for r in (0, 1)) for name in SHARDS}
    unsharded["norm.weight"] = float(grads[0]["norm.weight"].pow(2).sum())  # the replica, once
    total = math.fsum(unsharded.values())
    assert shares.sum_sq == pytest.approx(total, rel=1e-12) and total == pytest.approx(200.0)
    assert shares.num_params == 4
    assert [(s.param, round(s.share, 9)) for s in shares.top] == list(EXPECTED)
    for share in shares.top:
        assert share.sum_sq == pytest.approx(unsharded[share.param], rel=1e-12)
    assert shares.note == NOTE and shares.reason == ""


def test_the_terminal_and_markdown_name_the_largest_parameter_first_with_its_share(spike_dump):
    report = check(spike_dump)
    terminal = terminal_render.render_report(report, width=100)
    section = terminal[terminal.index("Parameters holding most of Σg²") :]
    assert (
        section.index("layers.11.mlp.w2") < section.index("layers.10.mlp.w2") < section.index("embed.weight")
    )
    row = next(line for line in section.splitlines() if line.lstrip().startswith("layers.11.mlp.w2"))
    assert row.endswith("100  50.0%")
    assert f"  a spike: {NOTE}" in section
    markdown = markdown_render.render_report(report)
    assert "| layers.11.mlp.w2 | 100 | 50.0% |" in markdown
    assert "| norm.weight | 30 | 15.0% |" in markdown


def test_untrusted_parameter_names_in_the_shares_are_escaped_in_every_human_format(spike_dump):
    report = check(spike_dump)
    assert report.sum_sq_shares is not None
    hostile = "[red]w\x1b[2J @octocat `x` | y"
    top = (dataclasses.replace(report.sum_sq_shares.top[0], param=hostile), *report.sum_sq_shares.top[1:])
    shares = dataclasses.replace(report.sum_sq_shares, top=top, note="note\nforged line")
    report = dataclasses.replace(report, sum_sq_shares=shares)
    terminal = terminal_render.render_report(report, width=200)
    assert "\x1b" not in terminal and "[red]w\\x1b[2J" in terminal
    assert "note\\nforged line" in terminal
    markdown = markdown_render.render_report(report)
    assert "\x1b" not in markdown and "@octocat" not in markdown
    assert "\\`x\\` \\| y |" in markdown  # a cell of the table, not two
    assert json.loads(json_render.render_report(report))["sum_sq_shares"]["top"][0]["param"] == hostile


def test_a_dump_not_written_at_a_spike_shows_no_parameter_shares_and_its_json_has_no_such_key(
    tmp_path: Path,
) -> None:
    report = check(write_spike_dump(tmp_path / "step_7", trigger=None))
    assert report.sum_sq_shares is None
    assert "sum_sq_shares" not in json.loads(json_render.render_report(report))
    assert "Σg² (total" not in terminal_render.render_report(report, width=100)
    assert "Parameters holding most" not in markdown_render.render_report(report)


def test_a_spike_dump_with_nonfinite_gradients_says_why_no_share_is_known(tmp_path: Path) -> None:
    report = check(write_spike_dump(tmp_path / "step_7", nan=True))
    shares = report.sum_sq_shares
    assert shares is not None and shares.top == ()
    assert "not finite" in shares.reason and "GA401" in shares.reason
    assert shares.reason in terminal_render.render_report(report, width=200)
    document = json.loads(json_render.render_report(report))
    assert document["sum_sq_shares"]["sum_sq"] == "nan"
    assert _schema_errors(document) == []


def test_a_failing_spike_steps_brief_in_a_run_report_names_the_largest_shares(spike_dump):
    report = check(spike_dump)
    error = Finding(code="GA201", severity=Severity.ERROR, title="t", message="m", ranks=(0,))
    failing = dataclasses.replace(report, findings=(error,))
    multi = MultiStepReport(directory="audit", steps=(failing,), summary=())
    line = "50.0% of Σg² in layers.11.mlp.w2, 25.0% in layers.10.mlp.w2, 15.0% in norm.weight"
    assert f"spike: {line}" in terminal_render.render_multi(multi, width=200)
    assert f"**spike:** {line}" in markdown_render.render_multi(multi)


# ---------------------------------------------------------------- a guarded run's trend


def spike_run_trend() -> list[TrendLine]:
    """12 clean steps around 1.1, step 7 spiking to 14.1421 (the guard dumped it), step 10 failing."""
    lines = []
    for step in range(1, 13):
        if step == SPIKE_STEP:
            norm = math.sqrt(200.0)
            lines.append(dataclasses.replace(clipped_line(step, true=norm, reported=norm), spike=True))
        elif step == 10:
            lines.append(clipped_line(step, codes=("GA201",), true=1.5, reported=0.75))
        else:
            lines.append(clipped_line(step, true=1.0 + step / 100, reported=1.0 + step / 100))
    return lines


@pytest.fixture
def spike_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    write_trend(Path("audit"), spike_run_trend())
    write_spike_dump(Path("audit") / f"step_{SPIKE_STEP}")
    return Path("audit")


def _audit(folder: Path) -> MultiStepReport:
    result = audit_folder(folder, AuditOptions())
    assert isinstance(result, MultiStepReport)
    return result


@pytest.mark.parametrize("suffix", sorted(MULTI))
def test_a_guarded_run_marks_its_spike_steps_in_its_trend_as_in_the_golden_file(request, spike_run, suffix):
    assert_golden(request, RENDERER_GOLDENS / f"spike_run.{suffix}", MULTI[suffix](_audit(spike_run)))


def test_the_run_report_counts_the_spikes_and_marks_the_spike_step_in_every_format(spike_run):
    multi = _audit(spike_run)
    trend = multi.guard_trend
    assert trend is not None
    assert [s.step for s in trend.spikes] == [SPIKE_STEP]
    assert trend.spikes[0].dump == str(Path("audit") / f"step_{SPIKE_STEP}")

    terminal = terminal_render.render_multi(multi, width=100)
    assert terminal.splitlines()[0].endswith(", 1 spike of the true norm")
    assert "spike at step 7: true norm 14.1421" in terminal
    chart_row = next(line for line in terminal.splitlines() if line.lstrip().startswith("7 #"))
    assert chart_row.endswith("14.1421 / 14.1421  spike")
    assert sum(line.endswith("spike") for line in terminal.splitlines()) == 1

    markdown = markdown_render.render_multi(multi)
    assert "**1 spike of the true norm** (the guard's `spike=`):" in markdown
    assert "- **step 7**: true norm 14.1421" in markdown
    assert "14.1421 / 14.1421  spike" in markdown

    document = json.loads(json_render.render_multi(multi))
    guard = document["guard_trend"]
    assert [s["step"] for s in guard["spikes"]] == [SPIKE_STEP] and guard["spikes"][0]["spike"] is True
    assert [s["step"] for s in guard["chart"] if s.get("spike")] == [SPIKE_STEP]
    assert all("spike" not in s for s in guard["failing"])
    assert document["steps"][0]["sum_sq_shares"]["top"][0]["param"] == "layers.11.mlp.w2"
    assert _schema_errors(document) == []


def test_a_run_without_a_spike_has_no_spike_keys_in_its_json(tmp_path: Path) -> None:
    write_trend(tmp_path / "clean", [clipped_line(s) for s in range(1, 4)])
    guard = json.loads(json_render.render_multi(_audit(tmp_path / "clean")))["guard_trend"]
    assert "spikes" not in guard and all("spike" not in s for s in guard["chart"])


# ---------------------------------------------------------------- the trend file


def test_a_spike_line_round_trips_through_the_trend_file_and_an_old_line_reads_as_no_spike(
    tmp_path: Path,
) -> None:
    spiking = dataclasses.replace(clipped_line(3, true=50.0, reported=50.0), spike=True)
    assert spiking.to_json()["spike"] is True
    assert "spike" not in clipped_line(2).to_json()  # a line without a spike keeps its bytes
    old = '{"step": 1, "true_norm": 1.2, "reported_norm": 1.2, "verdict": "ok", "codes": []}\n'
    file = tmp_path / TREND_FILE
    file.write_text(old + json.dumps(clipped_line(2).to_json()) + "\n" + json.dumps(spiking.to_json()) + "\n")
    lines = read_trend(file).lines
    assert [line.spike for line in lines] == [False, False, True]
    assert lines[2] == spiking


def test_a_trend_line_whose_spike_is_not_a_boolean_is_damage_named_with_itsclipped_line(
    tmp_path: Path,
) -> None:
    file = tmp_path / TREND_FILE
    file.write_text(json.dumps(clipped_line(1).to_json() | {"spike": "yes"}) + "\n")
    with pytest.raises(StepFolderError, match=r":1: spike must be true or false"):
        read_trend(file)


def _schema_errors(document: object) -> list[str]:
    validator = jsonschema.Draft202012Validator(json_render.report_schema())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
