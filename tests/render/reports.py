"""Audit reports built by hand, for the renderer tests and their golden files in tests/golden/."""

from __future__ import annotations

import math
from dataclasses import replace

from gradaudit.report.model import (
    Environment,
    Finding,
    MeshShape,
    MultiStepReport,
    NonfiniteCounts,
    NotChecked,
    ParamComparison,
    RankRow,
    Report,
    Severity,
    StepSummary,
    TopologySummary,
)


def wrong_reference(param: str) -> ParamComparison:
    """`param`'s gradient beyond the tolerances of the unsharded reference."""
    return ParamComparison(
        param=param,
        kind="grad",
        max_abs_error=0.1,
        max_rel_error=0.2,
        atol=1e-5,
        rtol=1e-4,
        within_tolerance=False,
    )


def seed_report(*, step: int = 1200) -> Report:
    """The seed scenario: four shards of norm 0.8 each, nobody clips, the true norm is 1.6."""
    ranks = tuple(
        RankRow(
            rank=r,
            local_norm=0.8,
            reported_norm=0.8,
            applied_clip_coef=1.0,
            applied_coef_source="gradients",
            diagnosis="local_only",
            diagnosis_detail="reported 0.8 = this rank's own pieces (rel. diff 0)",
            share_of_squared_norm=0.25,
        )
        for r in range(4)
    )
    return Report(
        step=step,
        world_size=4,
        ranks_present=(0, 1, 2, 3),
        missing_ranks=(),
        norm_type=2.0,
        max_norm=1.0,
        global_norm=1.6,
        expected_clip_coef=0.625,
        ranks=ranks,
        findings=(
            Finding(
                code="GA201",
                severity=Severity.ERROR,
                title="clipping used a local norm",
                message="every rank reported its own norm 0.8 while the true global norm is 1.6",
                ranks=(0, 1, 2, 3),
                params=("layers.0.weight", "layers.1.weight"),
                evidence={"reported_norm": 0.8, "true_norm": 1.6, "relative_difference": 0.5},
            ),
            Finding(
                code="GA302",
                severity=Severity.ERROR,
                title="applied coefficient differs from the expected one",
                message="ranks applied 1 but min(1, 1 / (1.6 + 1e-6)) = 0.625",
                ranks=(0, 1, 2, 3),
                evidence={"applied_clip_coef": 1.0, "expected_clip_coef": 0.625},
            ),
            Finding(
                code="GA701",
                severity=Severity.INFO,
                title="update norm vs gradient norm",
                message="the Adam update norm is 0.0123 while the clipped gradient norm is 1.6",
                evidence={"update_norm": 0.0123, "grad_norm": 1.6},
            ),
        ),
        not_checked=(
            NotChecked(
                code="GA502", title="clipping on scaled gradients", reason="no loss scale was recorded"
            ),
        ),
        verdict="clipping used each rank's local norm 0.8 instead of the global norm 1.6; "
        "the coefficient should have been 0.625, every rank applied 1",
        environment=Environment(
            auditor_version="0.1.0",
            dump_versions=("0.1.0",),
            torch_versions=("2.13.0",),
            hosts=("node-a", "node-b"),
            modes=("full",),
            world_size=4,
            run_ids=("run-42",),
        ),
        topology=TopologySummary(
            groups={"dp_shard": ((0, 1, 2, 3),)},
            mesh=MeshShape(shape=(4,), axis_names=("dp_shard",)),
            norm_group="dp_shard",
        ),
        reference=(
            ParamComparison(
                param="layers.0.weight",
                kind="grad",
                max_abs_error=1e-7,
                max_rel_error=2e-6,
                atol=1e-5,
                rtol=1e-4,
                within_tolerance=True,
            ),
            ParamComparison(
                param="layers.1.weight",
                kind="grad_clipped",
                max_abs_error=0.3,
                max_rel_error=0.6,
                atol=1e-5,
                rtol=1e-4,
                within_tolerance=False,
            ),
        ),
        command="gradaudit check ./run/step_1200 --reference ./ref/step_1200",
        warnings=("rank 2 recorded no tokens; GA702 used the other ranks",),
    )


def clean_report(*, step: int) -> Report:
    """Clipping done right: true norm 0.5 below max_norm, nothing to say."""
    ranks = tuple(
        RankRow(
            rank=r,
            local_norm=0.25,
            reported_norm=0.5,
            applied_clip_coef=1.0,
            applied_coef_source="reported",
            diagnosis="correct",
            share_of_squared_norm=0.25,
        )
        for r in range(4)
    )
    return Report(
        step=step,
        world_size=4,
        ranks_present=(0, 1, 2, 3),
        missing_ranks=(),
        norm_type=2.0,
        max_norm=1.0,
        global_norm=0.5,
        expected_clip_coef=1.0,
        ranks=ranks,
        findings=(),
        verdict="clipping used the true global norm 0.5; no clipping was needed",
        command=f"gradaudit check ./run/step_{step}",
    )


def missing_rank_report(*, step: int) -> Report:
    """Rank 3 never wrote its file: GA100, the other three audited."""
    base = seed_report(step=step)
    return replace(
        base,
        ranks_present=(0, 1, 2),
        missing_ranks=(3,),
        global_norm=None,
        expected_clip_coef=None,
        ranks=base.ranks[:3],
        findings=(
            Finding(
                code="GA100",
                severity=Severity.ERROR,
                title="ranks missing",
                message="rank 3 has no file in the step folder",
                ranks=(3,),
            ),
        ),
        not_checked=(
            NotChecked(
                code="GA201", title="local norm", reason="needs every rank's pieces; rank 3 is missing"
            ),
        ),
        reference=(),
        verdict="rank 3 is missing; the global norm could not be computed",
        command=f"gradaudit check ./run/step_{step}",
        warnings=(),
    )


def multi_report() -> MultiStepReport:
    steps = (clean_report(step=1100), seed_report(step=1200), missing_rank_report(step=1300))
    summary = tuple(
        StepSummary(
            step=r.step,
            directory=f"./run/step_{r.step}",
            global_norm=r.global_norm,
            reported_norm=r.ranks[0].reported_norm,
            expected_clip_coef=r.expected_clip_coef,
            num_errors=sum(f.severity is Severity.ERROR for f in r.findings),
            num_warnings=sum(f.severity is Severity.WARNING for f in r.findings),
            codes=tuple(f.code for f in r.findings),
        )
        for r in steps
    )
    return MultiStepReport(directory="./run", steps=steps, summary=summary)


def clipped_twice_report(*, step: int) -> Report:
    """A clip per micro-batch (GA501): the true norm 71 before the first call, 0.9 before the second."""
    base = clean_report(step=step)
    return replace(
        base,
        global_norm=0.9,
        expected_clip_coef=1.0,
        ranks=tuple(
            replace(row, reported_norm=0.9, diagnosis="correct (last of 2 calls)") for row in base.ranks
        ),
        findings=(
            Finding(
                code="GA501",
                severity=Severity.ERROR,
                title="clipping ran more than once before one optimizer step",
                message="ranks 0-3 clipped 2 times before one optimizer step (rank 0 reported norms 71, 0.9)",
                ranks=(0, 1, 2, 3),
                evidence={
                    "call_1_reported_norm": 71.0,
                    "call_1_true_norm": 71.0,
                    "call_2_true_norm": 0.9,
                    "first_rank": 0,
                    "num_calls": 2,
                },
            ),
        ),
        verdict="True global L2 norm 0.9 before the last of 2 clip calls with max_norm 1",
    )


def multi_clipped_twice_report() -> MultiStepReport:
    """A run folder whose step 2 clipped per micro-batch: its summary row, made by the audit's own
    `summarize`, carries the first call's norms, and so do the table and the chart."""
    from gradaudit.audit import summarize

    steps = (clean_report(step=1), clipped_twice_report(step=2), clean_report(step=3))
    summary = tuple(summarize(r, f"./run/step_{r.step}") for r in steps)
    return MultiStepReport(directory="./run", steps=steps, summary=summary)


def nonfinite_report() -> Report:
    """Rank 1 holds an inf and a nan: the global norm is nan, and so is everything derived from it."""
    base = seed_report(step=1400)
    ranks = tuple(
        replace(
            row,
            local_norm=math.inf,
            reported_norm=math.nan,
            applied_clip_coef=None,
            applied_coef_source=None,
            diagnosis=None,
            diagnosis_detail="",
            share_of_squared_norm=math.nan,
            nonfinite=NonfiniteCounts(nan=3, posinf=1),
        )
        if row.rank == 1
        else replace(row, reported_norm=math.nan, diagnosis=None, diagnosis_detail="")
        for row in base.ranks
    )
    return replace(
        base,
        norm_type=math.inf,
        global_norm=math.nan,
        expected_clip_coef=math.nan,
        ranks=ranks,
        findings=(
            Finding(
                code="GA401",
                severity=Severity.ERROR,
                title="nonfinite gradient values",
                message="rank 1 holds 3 nan and 1 +inf in layers.1.weight",
                ranks=(1,),
                params=("layers.1.weight",),
                evidence={
                    "nan": 3,
                    "posinf": 1,
                    "neginf": 0,
                    "max_abs": math.inf,
                    "global_norm": math.nan,
                    "min": -math.inf,
                    "first_rank": 1,
                },
            ),
        ),
        reference=(),
        verdict="rank 1 has nonfinite gradients (3 nan, 1 +inf); the global norm is nan",
        command="gradaudit check ./run/step_1400",
    )


HOSTILE_NAMES = (
    "layers.[red]0[/red].weight",
    "a|b|c",
    "code`tick``s",
    "line\nbreak",
    "\x1b[31mansi\x1b[0m",
    "权重.é.λ",
    "<script>alert(1)</script>",
    "*bold* _it_ [link](http://x) :thumbs_up: ~~s~~ $x$ &amp;",
    "- 1. # heading",
    "back\\slash\\",
    "\u202eevil",
    "lone\ud800surrogate",
)


def hostile_report() -> Report:
    base = seed_report(step=7)
    joined = " / ".join(HOSTILE_NAMES)
    return replace(
        base,
        ranks=tuple(
            replace(
                row,
                applied_coef_source=HOSTILE_NAMES[0],
                diagnosis=f"wrong_group:{HOSTILE_NAMES[1]}",
                diagnosis_detail=joined,
            )
            for row in base.ranks
        ),
        findings=(
            Finding(
                code="GA204",
                severity=Severity.ERROR,
                title=f"title {HOSTILE_NAMES[2]}",
                message=f"message {joined}",
                ranks=(0,),
                params=HOSTILE_NAMES,
                evidence={"group": HOSTILE_NAMES[1], HOSTILE_NAMES[0]: 1.5},
            ),
        ),
        not_checked=(NotChecked(code="GA502", title=HOSTILE_NAMES[3], reason=HOSTILE_NAMES[4]),),
        reference=tuple(wrong_reference(name) for name in HOSTILE_NAMES),
        verdict=f"verdict {joined}",
        environment=Environment(
            auditor_version=HOSTILE_NAMES[2],
            torch_versions=(joined,),
            hosts=HOSTILE_NAMES,
            run_ids=HOSTILE_NAMES,
        ),
        topology=TopologySummary(
            groups={HOSTILE_NAMES[0]: ((0, 1), (2, 3)), HOSTILE_NAMES[1]: ((0, 1, 2, 3),)},
            mesh=MeshShape(shape=(2, 2), axis_names=(HOSTILE_NAMES[3], HOSTILE_NAMES[4])),
            norm_group=HOSTILE_NAMES[5],
        ),
        command="gradaudit check './step_7/```\n[red]|x'",
        warnings=HOSTILE_NAMES,
    )
