"""The one table of checks: code, severity, title, explanation and the function that runs it.

The check modules are named here but imported only when a check first runs, so that `gradaudit explain`
reads this table without loading the measuring code (see `deferred`).
"""

from __future__ import annotations

import importlib
import textwrap
from typing import TYPE_CHECKING

from ..report import Finding, NotChecked, Severity
from .base import AuditOptions, CheckFn, CheckResult, CheckSpec
from .explanations import EXPLANATIONS

if TYPE_CHECKING:
    from ..engine.measure import StepMeasurements
    from ..model import StepDump


class DeferredCheck:
    """`module.function` of this package, imported on its first call."""

    __slots__ = ("function", "module")

    def __init__(self, module: str, function: str) -> None:
        self.module, self.function = module, function

    def resolve(self) -> CheckFn:
        fn: CheckFn = getattr(importlib.import_module(f"{__package__}.{self.module}"), self.function)
        return fn

    def __call__(self, step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
        return self.resolve()(step, m, options)


def deferred(target: str) -> DeferredCheck:
    """The check `module.function` of this package, imported on its first call."""
    module, function = target.split(".")
    return DeferredCheck(module=module, function=function)


ERROR, WARNING, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO

_TABLE = (
    ("GA100", ERROR, "ranks missing from the step folder", deferred("coverage.missing_ranks")),
    ("GA101", ERROR, "ranks disagree on run metadata", deferred("coverage.metadata_disagreement")),
    ("GA102", ERROR, "ownership overlap", deferred("coverage.ownership_overlap")),
    ("GA103", ERROR, "ownership gap", deferred("coverage.ownership_gap")),
    ("GA104", WARNING, "parameters the capture left out", deferred("coverage.parameters_not_captured")),
    ("GA201", ERROR, "clipping used a local norm", deferred("norm.local_norm")),
    ("GA202", ERROR, "norm counts replicated gradients more than once", deferred("norm.double_counted")),
    ("GA203", ERROR, "norm reduced over the wrong process group", deferred("norm.wrong_group")),
    ("GA204", ERROR, "norm matches no known mistake", deferred("norm.unexplained")),
    (
        "GA205",
        WARNING,
        "reported norm is wrong but clipping used the right one",
        deferred("norm.logging_bug"),
    ),
    ("GA206", WARNING, "clipping was not checked", deferred("norm.not_checked")),
    ("GA207", ERROR, "norm accounts one group of parameters wrongly", deferred("norm.param_group_mistake")),
    (
        "GA208",
        ERROR,
        "norm averages per-rank norms instead of summing squares",
        deferred("norm.averaged_norms"),
    ),
    ("GA209", ERROR, "norm overflowed in its working precision", deferred("norm.overflowed")),
    (
        "GA301",
        ERROR,
        "ranks applied different clip coefficients",
        deferred("coefficients.coefficients_differ"),
    ),
    (
        "GA302",
        ERROR,
        "applied coefficient differs from the expected one",
        deferred("coefficients.coefficient_vs_expected"),
    ),
    ("GA303", ERROR, "post-clip global norm exceeds max_norm", deferred("coefficients.post_clip_norm")),
    ("GA401", ERROR, "nonfinite gradient values", deferred("nonfinite.nonfinite_gradients")),
    ("GA402", ERROR, "ranks disagree on nonfinite or skipped step", deferred("nonfinite.skip_disagreement")),
    (
        "GA501",
        ERROR,
        "clipping ran more than once before one optimizer step",
        deferred("procedure.clipped_more_than_once"),
    ),
    (
        "GA502",
        ERROR,
        "clipping ran on scaled gradients (before GradScaler.unscale_)",
        deferred("procedure.clipped_scaled_gradients"),
    ),
    ("GA503", ERROR, "gradients were captured after clipping", deferred("postclip.captured_after_clipping")),
    (
        "GA504",
        ERROR,
        "gradients were clipped before the recorded clip call",
        deferred("unrecorded.clipped_before_the_recorded_call"),
    ),
    ("GA505", ERROR, "no clip call although max_norm was declared", deferred("unrecorded.no_clip_call")),
    (
        "GA506",
        ERROR,
        "clipping was element-wise (clip by value), not by norm",
        deferred("valueclip.clipped_by_value"),
    ),
    ("GA601", ERROR, "pieces that should be replicas differ", deferred("replicas.replicas_differ")),
    ("GA602", ERROR, "gradients differ from the unsharded reference", deferred("reference.gradients_differ")),
    (
        "GA603",
        ERROR,
        "clipped gradients or next weights differ from the unsharded reference",
        deferred("reference.clipped_or_next_weights_differ"),
    ),
    (
        "GA604",
        INFO,
        "next weights differ only as the optimizer's normalisation of agreeing gradients explains",
        deferred("reference.updates_explained_by_optimizer"),
    ),
    (
        "GA605",
        ERROR,
        "replicas' weights differ at the start of the step",
        deferred("replica_weights.replica_weights_differ"),
    ),
    ("GA701", INFO, "update norm vs gradient norm", deferred("updates.update_vs_gradient")),
    (
        "GA702",
        WARNING,
        "ranks averaged their own loss over different token counts",
        deferred("procedure.uneven_token_means"),
    ),
)

DECIDED_WITHOUT_MISSING_RANKS = ("GA100", "GA101", "GA104", "GA303", "GA604", "GA701")
"""Checks whose clean result stands with ranks missing (the others then say they could not decide)."""

CHECKS: tuple[CheckSpec, ...] = tuple(
    CheckSpec(
        code=code,
        severity=severity,
        title=title,
        explanation=EXPLANATIONS[code],
        run=run,
        needs_all_ranks=code not in DECIDED_WITHOUT_MISSING_RANKS,
    )
    for code, severity, title, run in _TABLE
)
"""Every check, in code order. Codes are never reused: retire a code by removing its row, never renumber."""

BY_CODE = {spec.code: spec for spec in CHECKS}


def run_checks(
    step: StepDump, m: StepMeasurements, options: AuditOptions
) -> tuple[tuple[Finding, ...], tuple[NotChecked, ...]]:
    """Run every check; findings sorted by (severity, code, ranks, params), not-checked by code."""
    from .valueclip import NORM_CLIPPING_CODES, gate

    findings: list[Finding] = []
    not_checked: list[NotChecked] = []
    by_value = gate(step, m)
    for spec in CHECKS:
        if by_value is not None and spec.code in NORM_CLIPPING_CODES:
            not_checked.append(NotChecked(code=spec.code, title=spec.title, reason=by_value))
            continue
        result = spec.apply(step, m, options)
        if isinstance(result, NotChecked):
            not_checked.append(result)
        else:
            findings.extend(result)
    return tuple(sorted(findings, key=lambda f: f.sort_key)), tuple(not_checked)


def explain(code: str, width: int = 88) -> str:
    """The text `gradaudit explain CODE` prints."""
    spec = BY_CODE[code.upper()]
    e = spec.explanation
    sections = (
        ("What it checks", e.what),
        ("Why it matters", e.why),
        ("Example", e.example),
        ("How to fix it", e.fix),
    )
    body = "\n\n".join(
        f"{heading}\n" + textwrap.fill(text, width=width, initial_indent="  ", subsequent_indent="  ")
        for heading, text in sections
    )
    return f"{spec.code} ({spec.severity.value}): {spec.title}\n\n{body}\n"


def explain_all() -> str:
    """One line per code: code, severity, title."""
    return "".join(f"{spec.code}  {spec.severity.value:<7}  {spec.title}\n" for spec in CHECKS)
