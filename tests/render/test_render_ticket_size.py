"""Reports that fit a ticket: Markdown stays under 20,000 characters at any world size, leads with the verdict
and the findings, folds ranks that agree, and the JSON report still holds every rank."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from gradaudit.render import json as json_render
from gradaudit.render import markdown as markdown_render
from gradaudit.render import terminal as terminal_render
from gradaudit.report.model import (
    Environment,
    Finding,
    NonfiniteCounts,
    NotChecked,
    RankRow,
    Report,
    Severity,
    TopologySummary,
)
from render.reports import wrong_reference

TICKET_LIMIT = 20_000
RANKS_PER_HOST = 8


def big_report(
    world_size: int,
    *,
    outliers: dict[int, str] | None = None,
    nonfinite_ranks: tuple[int, ...] = (),
    num_findings: int = 2,
    name_length: int = 40,
    every_rank_differs: bool = False,
) -> Report:
    """A report as the audit builds it for `world_size` ranks of an FSDP run with dp groups of 8.

    Every rank's local norm differs slightly (as real shards do); `outliers` gives some ranks another
    diagnosis; `every_rank_differs` gives each rank its own diagnosis and coefficient (the worst case).
    """
    outliers = outliers or {}
    share = 1.0 / world_size
    rows = []
    for rank in range(world_size):
        diagnosis = outliers.get(rank, "correct")
        coef = 0.5
        if every_rank_differs:
            diagnosis, coef = f"wrong_group:group_{rank}_" + "x" * name_length, 0.5 + rank * 1e-7
        rows.append(
            RankRow(
                rank=rank,
                local_norm=0.01 * (1 + (rank % 97) / 1000),
                reported_norm=2.0,
                applied_clip_coef=coef,
                applied_coef_source="gradients",
                diagnosis=diagnosis,
                diagnosis_detail=f"reported 2 = the norm of group {diagnosis} (rel. diff {rank % 7}e-9)",
                share_of_squared_norm=share,
                nonfinite=NonfiniteCounts(nan=3) if rank in nonfinite_ranks else NonfiniteCounts(),
            )
        )
    params = tuple(f"model.layers.{i}.{'w' * name_length}" for i in range(800))
    findings = tuple(
        Finding(
            code=f"GA{201 + i % 5}",
            severity=Severity.ERROR if i % 3 else Severity.WARNING,
            title="norm reduced over the wrong process group",
            message=f"finding {i}: ranks reported 2 while the true global norm is 1; " + "detail " * 40,
            ranks=tuple(range(0, world_size, 2)),
            params=params,
            evidence={"reported_norm": 2.0, "true_norm": 1.0, "group": "dp_shard"},
        )
        for i in range(num_findings)
    )
    return Report(
        step=1200,
        world_size=world_size,
        ranks_present=tuple(range(world_size)),
        missing_ranks=(),
        norm_type=2.0,
        max_norm=1.0,
        global_norm=1.0,
        expected_clip_coef=0.5,
        ranks=tuple(rows),
        findings=findings,
        not_checked=tuple(
            NotChecked(code=f"GA{700 + i}", title="check", reason="no evidence " * 20) for i in range(30)
        ),
        verdict="clipping used a norm reduced over the wrong group" if findings else "clipping was right",
        environment=Environment(
            auditor_version="0.1.0",
            dump_versions=("0.1.0",),
            torch_versions=("2.13.0",),
            hosts=tuple(f"node-{h:05d}" for h in range(max(1, world_size // RANKS_PER_HOST))),
            modes=("stats",),
            world_size=world_size,
            run_ids=("run-1",),
        ),
        topology=TopologySummary(
            groups={
                "dp_shard": tuple(tuple(range(s, min(s + 8, world_size))) for s in range(0, world_size, 8)),
                "dp_replicate": tuple(tuple(range(i, world_size, 8)) for i in range(min(8, world_size))),
            },
            norm_group="dp_shard",
        ),
        reference=tuple(wrong_reference(name) for name in params),
        command="gradaudit check ./run/step_1200",
        warnings=tuple(f"rank {r} recorded no tokens" for r in range(0, world_size, 3)),
    )


def _rank_table_rows(markdown: str) -> list[str]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| ranks |")) + 2
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


@pytest.mark.parametrize("world_size", [1, 8, 1024, 4096, 16384])
def test_markdown_of_a_clean_step_fits_a_ticket_at_any_world_size(world_size: int) -> None:
    report = big_report(world_size, num_findings=0)
    markdown = markdown_render.render_report(report)
    assert len(markdown) <= TICKET_LIMIT
    assert "left out to keep this report short" not in markdown


@pytest.mark.parametrize("world_size", [1024, 4096])
def test_markdown_of_4096_ranks_with_outliers_fits_and_lists_each_outlier(world_size: int) -> None:
    outliers = {17: "local_only", 2049 % world_size: "replicas_double_counted", world_size - 1: "local_only"}
    report = big_report(world_size, outliers=outliers, nonfinite_ranks=(1000,), num_findings=3)
    markdown = markdown_render.render_report(report)
    assert len(markdown) <= TICKET_LIMIT
    rows = _rank_table_rows(markdown)
    listed = {
        int(rank)
        for row in rows
        if "…" not in (cell := row.split(" | ")[0].removeprefix("| ")) and "-" not in cell
        for rank in cell.split(", ")
    }
    assert {17, 1000, 2049 % world_size, world_size - 1} <= listed
    assert len(rows) <= markdown_render.MAX_RANK_GROUPS
    assert "| 1000 |" in markdown and "3 nan" in markdown


def test_markdown_stays_under_the_limit_when_every_rank_differs_and_names_are_long() -> None:
    report = big_report(4096, every_rank_differs=True, num_findings=40, name_length=400)
    markdown = markdown_render.render_report(report)
    assert len(markdown) <= TICKET_LIMIT
    assert markdown.index("## Findings") < markdown.index("## Ranks")
    assert "more ranks in" in markdown and "--format json" in markdown


def test_markdown_leads_with_the_verdict_and_findings_and_puts_long_parts_in_details() -> None:
    markdown = markdown_render.render_report(big_report(4096, outliers={5: "local_only"}, num_findings=30))
    headings = [line for line in markdown.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## Findings", "## Not checked", "## Ranks"]
    assert markdown.splitlines()[2].startswith("**✗ Verdict:**")
    assert "more findings</summary>" in markdown
    assert "<details><summary>Reference table" in markdown
    assert "<details><summary>Versions, hosts and process groups (world size 4096, 512 hosts" in markdown
    assert markdown.count("<details>") == markdown.count("</details>")


def test_json_report_keeps_every_rank_while_markdown_and_terminal_fold_them() -> None:
    report = big_report(4096, outliers={5: "local_only"})
    data = json.loads(json_render.render_report(report))
    assert [row["rank"] for row in data["ranks"]] == list(range(4096))
    assert len(data["topology"]["groups"]["dp_shard"]) == 512
    terminal = terminal_render.render_report(report)
    assert len(terminal.splitlines()) < 300
    assert re.search(r"^\s+5\s", terminal, re.M)


def test_folded_numbers_show_the_range_of_the_ranks_in_the_row() -> None:
    report = big_report(4096)
    markdown = markdown_render.render_report(report)
    low, high = 0.01, 0.01 * (1 + 96 / 1000)
    assert f"| 0.01–{high:.6g} |" in markdown and not math.isclose(low, high)


def test_markdown_with_every_rank_asked_for_lists_each_rank() -> None:
    markdown = markdown_render.render_report(big_report(64), fold=False)
    assert all(f"\n| {rank} | " in markdown for rank in range(64))


def test_a_folder_of_many_steps_lists_quiet_steps_in_one_line_and_bounds_the_step_sections() -> None:
    from dataclasses import replace

    from gradaudit.report.model import MultiStepReport, StepSummary

    noisy = big_report(64, num_findings=3)
    quiet = replace(big_report(64, num_findings=0), warnings=())
    steps = tuple(replace(noisy if s % 2 else quiet, step=s) for s in range(200))
    summary = tuple(
        StepSummary(
            step=r.step,
            directory=f"run/step_{r.step}",
            global_norm=r.global_norm,
            reported_norm=2.0,
            expected_clip_coef=r.expected_clip_coef,
            num_errors=len(r.findings),
            num_warnings=0,
            codes=tuple(f.code for f in r.findings),
        )
        for r in steps
    )
    markdown = markdown_render.render_multi(MultiStepReport(directory="run", steps=steps, summary=summary))
    assert "No errors, warnings or missing ranks in steps 0, 2, 4," in markdown
    assert "## Step 0\n" not in markdown and "## Step 1\n" in markdown
    assert "more failing steps not shown" in markdown
    assert "<details><summary>Summary of the 200 steps (200 rows)</summary>" in markdown
    assert len(markdown) < 12_000 + 200 * 120


def test_a_real_4096_rank_dump_with_a_few_outlier_ranks_gives_a_ticket_sized_markdown_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end: builder-written rank files, `gradaudit check`, Markdown and JSON."""
    import torch
    from builders import clip, sharded_rows

    from gradaudit.cli import main

    world_size, outliers = 4096, (7, 3000)
    grads = [torch.full((1, 4), 0.01 * (1 + r % 5), dtype=torch.float64) for r in range(world_size)]
    true = float(torch.cat(grads).norm())
    clips = {
        r: clip(2.0, reported_norm=float(grads[r].norm()) if r in outliers else true, clip_coef=1.0)
        for r in range(world_size)
    }
    step = sharded_rows(tmp_path / "step_1", grads, clips=clips)
    outputs = {}
    for fmt in ("markdown", "json"):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(["check", str(step), "--format", fmt])
        outputs[fmt] = capsys.readouterr().out
    markdown = outputs["markdown"]
    assert len(markdown) <= TICKET_LIMIT
    assert markdown.index("## Findings") < markdown.index("## Ranks")
    rows = _rank_table_rows(markdown)
    assert len(rows) <= markdown_render.MAX_RANK_GROUPS
    assert any(row.startswith(("| 7, 3000 |", "| 7 |")) for row in rows), rows
    assert [row["rank"] for row in json.loads(outputs["json"])["ranks"]] == list(range(world_size))
