"""The result of auditing a step: findings and per-rank rows, as plain frozen values for the renderers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # `gradaudit explain` reads the report's values without loading the dump's model
    from ..model import Mode, TensorKind
    from .param_shares import SumSqShares

REPORT_VERSION = 3
"""Bumped whenever the JSON report changes shape; docs/REPORT.md lists the versions and what changed."""

Number = int | float


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        """Sort order: errors first."""
        return {"error": 0, "warning": 1, "info": 2}[self.value]


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem found, with its evidence as numbers."""

    code: str
    """The finding code, GAnnn (a row of checks/registry.CHECKS)."""
    severity: Severity
    """Its code's severity."""
    title: str
    """Its code's one-line title."""
    message: str
    """What was found, with the numbers."""
    ranks: tuple[int, ...] = ()
    """The ranks it concerns, ascending; () for the whole step."""
    params: tuple[str, ...] = ()
    """The parameters it concerns; () for the whole step."""
    evidence: Mapping[str, Number | str | None] = field(default_factory=dict)
    """The numbers behind the message, by name (written to the JSON report)."""
    fix: str = ""
    """What to change (errors and warnings): the fix of the code's explanation, for the stack the dump
    shows (see gradaudit/checks/fixes.py); `gradaudit explain CODE` prints the whole explanation."""

    @property
    def sort_key(self) -> tuple[int, str, tuple[int, ...], tuple[str, ...], str]:
        return (self.severity.rank, self.code, self.ranks, self.params, self.message)


@dataclass(frozen=True, kw_only=True)
class NotChecked:
    """A check that could not decide, and why (never a silent pass)."""

    code: str
    """The finding code that could not be decided."""
    title: str
    """Its code's one-line title."""
    reason: str
    """Why the check could not decide (missing ranks, tensors not dumped, ...)."""


@dataclass(frozen=True, kw_only=True)
class NonfiniteCounts:
    nan: int = 0
    """NaN gradient elements."""
    posinf: int = 0
    """+inf gradient elements."""
    neginf: int = 0
    """-inf gradient elements."""

    @property
    def total(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True, kw_only=True)
class RankRow:
    """One rank's line in the report."""

    rank: int
    """The global rank."""
    local_norm: float
    """Norm of this rank's own pieces (pre-clip), as a local-only clip would compute it."""
    reported_norm: float | None
    """The norm this rank's training code reported; None when it recorded none."""
    applied_clip_coef: float | None
    """The coefficient this rank applied (see `applied_coef_source`); None when unknown."""
    applied_coef_source: str | None = None
    """"gradients" (from pre/post-clip tensors), "reported", or None when unknown."""
    diagnosis: str | None = None
    """The hypothesis code that best explains the reported norm: "correct", "local_only",
    "replicas_double_counted", "wrong_group:<name>", "loss_scaled:<hypothesis>", "unexplained", or None."""
    diagnosis_detail: str = ""
    """The diagnosis in words, for the renderers."""
    share_of_squared_norm: float = 0.0
    """This rank's contribution to the squared global norm (replicas attributed to their lowest rank)."""
    nonfinite: NonfiniteCounts = field(default_factory=NonfiniteCounts)
    """Nonfinite elements of this rank's gradients before clipping."""


@dataclass(frozen=True, kw_only=True)
class ParamComparison:
    """One parameter compared with the unsharded reference (`--reference`)."""

    param: str
    """The logical parameter."""
    kind: TensorKind
    """The tensor kind compared: "grad", "grad_clipped", "param_after"."""
    max_abs_error: float
    """max |ours - reference| over elements finite in both; inf when nonfinite values differ."""
    max_rel_error: float
    """`max_abs_error` / max |reference|; inf when nonfinite values differ."""
    atol: float
    """The absolute tolerance used."""
    rtol: float
    """The relative tolerance used."""
    within_tolerance: bool
    """Whether max_abs_error <= atol + rtol * max |reference|."""


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Fingerprint of the run: which versions wrote and audited the dump, on which hosts, in which mode."""

    auditor_version: str = ""
    """The gradaudit version that made this report."""
    dump_versions: tuple[str, ...] = ()
    """The gradaudit versions that wrote the rank files (one, unless the files were mixed)."""
    torch_versions: tuple[str, ...] = ()
    """The torch versions that trained, one per distinct value."""
    hosts: tuple[str, ...] = ()
    """The hosts of the rank files, one per distinct value."""
    modes: tuple[Mode, ...] = ()
    """Capture modes of the rank files: "full" (tensors) and/or "stats" (statistics only)."""
    world_size: int | None = None
    """The step's world size; None when not known."""
    run_ids: tuple[str, ...] = ()
    """The run ids of the rank files, one per distinct value."""


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    shape: tuple[int, ...]
    """Size of the device mesh along each axis."""
    axis_names: tuple[str, ...]
    """One name per axis of `shape`."""


@dataclass(frozen=True, kw_only=True)
class TopologySummary:
    """The process groups the dump recorded: name -> rank lists, the device mesh, the norm's group."""

    groups: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Group name -> every rank list of that group."""
    mesh: MeshShape | None = None
    """The device mesh; None without one."""
    norm_group: str | None = None
    """The group the clip call reduced its norm over; None when unknown."""


@dataclass(frozen=True, kw_only=True)
class Report:
    """Everything a renderer needs; built by the audit, never mutated."""

    step: int
    """The optimizer step audited."""
    world_size: int
    """Number of ranks of the run."""
    ranks_present: tuple[int, ...]
    """Ranks with a readable file, ascending."""
    missing_ranks: tuple[int, ...]
    """Ranks of the world size without a readable file."""
    norm_type: float | None
    """`p` of the norm the audit recomputed (the recorded clipping's, else 2)."""
    max_norm: float | None
    """The clipping threshold; None when the dump recorded no clipping."""
    global_norm: float | None
    """The true global norm recomputed from the dump; None when it cannot be."""
    expected_clip_coef: float | None
    """min(1, max_norm / (global_norm + 1e-6)): the coefficient correct clipping applies."""
    ranks: tuple[RankRow, ...]
    """One row per present rank, ascending."""
    findings: tuple[Finding, ...]
    """Every finding, sorted (severity, code, ranks, params, message)."""
    not_checked: tuple[NotChecked, ...] = ()
    """The checks that could not decide, with why."""
    verdict: str = ""
    """One sentence: the principal finding, or that clipping was right."""
    environment: Environment = field(default_factory=Environment)
    """Versions, hosts and modes of the rank files."""
    topology: TopologySummary = field(default_factory=TopologySummary)
    """The process groups the dump recorded."""
    reference: tuple[ParamComparison, ...] = ()
    """Per parameter and kind, the comparison with the reference (empty without --reference)."""
    command: str = ""
    """The command line that reproduces this report."""
    warnings: tuple[str, ...] = ()
    """What the loader skipped and other notes, to be shown to the user."""
    report_version: int = REPORT_VERSION
    """The JSON report's shape version (REPORT_VERSION)."""
    sum_sq_shares: SumSqShares | None = None
    """Of a step the guard dumped at a spike of its true norm: the parameters holding most of Σg²;
    None otherwise (and then absent from the JSON report)."""

    @property
    def worst_severity(self) -> Severity | None:
        return min((f.severity for f in self.findings), key=lambda s: s.rank, default=None)


@dataclass(frozen=True, kw_only=True)
class FirstCall:
    """A step's numbers as a run's summary, its trend line and the guard's log show them. With several
    clip calls (GA501) they are the first call's: its reported norm, the true norm and the expected
    coefficient before it (the later calls see a gradient the earlier ones clipped; the step's own
    report shows the last call's)."""

    true_norm: float | None
    """The true global norm (with several calls, before the first)."""
    reported_norm: float | None
    """The lowest rank's that reported one (with several calls, GA501's `first_rank`'s)."""
    expected_clip_coef: float | None
    """min(1, max_norm / (true_norm + 1e-6)), as that true norm expects."""
    clip_calls: int = 1
    """Above 1, the numbers are the first call's, and the step's report differs from them."""


def first_call_numbers(report: Report) -> FirstCall:
    reported = next((row.reported_norm for row in report.ranks if row.reported_norm is not None), None)
    numbers = FirstCall(
        true_norm=report.global_norm, reported_norm=reported, expected_clip_coef=report.expected_clip_coef
    )
    for finding in report.findings:
        evidence = finding.evidence
        calls, first = evidence.get("num_calls"), _number(evidence.get("call_1_true_norm"))
        if not isinstance(calls, int) or (first is None and "call_1_reported_norm" not in evidence):
            continue
        if "call_1_reported_norm" in evidence:  # absent from a report written before it was added
            numbers = replace(numbers, reported_norm=_number(evidence["call_1_reported_norm"]))
        if first is None:
            # no per-call statistics: the dumped gradient, so the report's true norm, is before the first call
            return numbers
        from ..norms import expected_clip_coef

        coef = None if report.max_norm is None else expected_clip_coef(first, report.max_norm)
        return replace(numbers, true_norm=first, expected_clip_coef=coef, clip_calls=calls)
    return numbers


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True, kw_only=True)
class StepSummary:
    """One line of the multi-step table: reported vs true norm per step."""

    step: int
    """The optimizer step."""
    directory: str
    """The step folder."""
    global_norm: float | None
    """The true global norm (with several clip calls, GA501, the one before the first: see
    `first_call_numbers`); None when it cannot be recomputed."""
    reported_norm: float | None
    """The norm the training code reported (lowest rank that reported one; with several clip calls
    its first call's, see `first_call_numbers`)."""
    expected_clip_coef: float | None
    """The coefficient correct clipping applies to `global_norm`."""
    num_errors: int
    """Findings of severity error."""
    num_warnings: int
    """Findings of severity warning."""
    codes: tuple[str, ...]
    """The distinct finding codes, sorted."""


TrendVerdict = Literal["ok", "anomaly", "skipped"]

CHART_STEPS = 12
"""The last checked steps of a guarded run whose true and reported norm the report draws."""


@dataclass(frozen=True, kw_only=True)
class TrendStep:
    """One step the guard checked during training, as its trend file has it."""

    step: int
    """The optimizer step."""
    verdict: TrendVerdict
    """"ok" (clipping right), "anomaly" (an error found: `codes`) or "skipped" (every rank's GradScaler
    skipped the step: nothing was clipped, nothing checked)."""
    codes: tuple[str, ...] = ()
    """The step's error codes, in the guard's order; empty unless `verdict` is "anomaly"."""
    true_norm: float | None = None
    """The true global norm (with several clip calls, before the first)."""
    reported_norm: float | None = None
    """What the clip call returned on rank 0 (with several, the first call's); None: no clip call."""
    expected_coef: float | None = None
    """The coefficient correct clipping applies to `true_norm`."""
    min_coef: float | None = None
    """The smallest coefficient the ranks applied (the last clip call's)."""
    max_coef: float | None = None
    """The largest coefficient the ranks applied (the last clip call's)."""
    clip_calls: int = 1
    """The most clip calls a rank made in the step (GA501 above 1)."""
    dump: str | None = None
    """The step's dump folder in the run folder; None when the guard wrote none (its max_dumps or
    cooldown said no, or the step was clean)."""
    spike: bool = False
    """The step's true norm spiked (the guard's `spike=`): the guard dumped its per-parameter statistics.
    In the JSON report only when true."""

    def __post_init__(self) -> None:
        if (self.verdict == "anomaly") != bool(self.codes):
            raise ValueError(
                f"step {self.step}: a trend step has codes exactly when its verdict is 'anomaly', "
                f"got verdict {self.verdict!r} with codes {list(self.codes)}"
            )
        if self.clip_calls < 1:
            raise ValueError(f"step {self.step}: clip_calls must be at least 1, got {self.clip_calls}")


@dataclass(frozen=True, kw_only=True)
class GuardTrend:
    """A guarded run's trend file (one line per step gradaudit.guard checked) as the report shows it:
    every failing step, those the guard warned about without dumping them, and the last steps' norms.
    The file itself keeps every line."""

    file: str
    """The trend file (out_dir/guard_trend.jsonl)."""
    num_checked: int
    """Steps the guard checked (lines of the file)."""
    num_clean: int
    """Checked steps whose clipping was right."""
    num_skipped: int
    """Checked steps every rank's GradScaler skipped (neither clean nor failing)."""
    failing: tuple[TrendStep, ...]
    """Every step with wrong clipping, in file order, each with its dump folder if the guard wrote one."""
    not_dumped: tuple[int, ...]
    """The failing steps with no dump in the run folder: the guard warned (or raised) live, but its
    max_dumps or cooldown kept it from writing one; only the trend tells of them."""
    chart: tuple[TrendStep, ...]
    """The last CHART_STEPS checked steps, in file order: the true vs reported norm."""
    full_captures: tuple[str, ...] = ()
    """The run folder's full/step_<N> folders (the step after an anomaly, captured in full)."""
    num_unread: int = 0
    """Older lines of the trend file not read (only the newest are, see live.trend.MAX_TREND_LINES):
    their failing steps are not known."""
    notes: tuple[str, ...] = ()
    """What of the trend file was not read (older lines, a last line cut short), one sentence each."""
    spikes: tuple[TrendStep, ...] = ()
    """Every step whose true norm spiked (the guard's `spike=`), in file order, each with its dump
    folder if the guard wrote one. In the JSON report only when some step spiked."""

    def __post_init__(self) -> None:
        if self.num_unread < 0:
            raise ValueError(f"{self.file}: num_unread must be 0 or more, got {self.num_unread}")
        if not all(s.spike for s in self.spikes):
            raise ValueError(
                f"{self.file}: spikes holds a step that did not spike; build it with guard_trend()"
            )
        if self.num_clean + len(self.failing) + self.num_skipped != self.num_checked:
            raise ValueError(
                f"{self.file}: {self.num_checked} checked steps must be the clean ({self.num_clean}), "
                f"failing ({len(self.failing)}) and skipped ({self.num_skipped}) ones; build it with guard_trend()"
            )
        unknown = set(self.not_dumped) - {s.step for s in self.failing}
        if unknown:
            raise ValueError(f"{self.file}: not_dumped names steps that are not failing: {sorted(unknown)}")


def guard_trend(
    steps: Iterable[TrendStep],
    *,
    file: str,
    dumps: Mapping[int, str],
    full_captures: Sequence[str] = (),
    chart_steps: int = CHART_STEPS,
    num_unread: int = 0,
    notes: Sequence[str] = (),
) -> GuardTrend:
    """The report's view of a trend: `steps` in file order, `dumps` the run folder's step_<N> folders
    by N (the guard's dumps)."""
    verdicts: Counter[TrendVerdict] = Counter()
    failing: list[TrendStep] = []
    spikes: list[TrendStep] = []
    last: list[TrendStep] = []
    for step in steps:
        verdicts[step.verdict] += 1
        dumped = dumps.get(step.step)
        if dumped != step.dump:
            step = replace(step, dump=dumped)
        if step.verdict == "anomaly":
            failing.append(step)
        if step.spike:
            spikes.append(step)
        last.append(step)
        if len(last) > 2 * chart_steps:
            del last[:chart_steps]
    return GuardTrend(
        file=file,
        num_checked=verdicts.total(),
        num_clean=verdicts["ok"],
        num_skipped=verdicts["skipped"],
        failing=tuple(failing),
        not_dumped=tuple(dict.fromkeys(s.step for s in failing if s.dump is None)),
        chart=tuple(last[-chart_steps:]) if chart_steps > 0 else (),
        full_captures=tuple(full_captures),
        num_unread=num_unread,
        notes=tuple(notes),
        spikes=tuple(spikes),
    )


@dataclass(frozen=True, kw_only=True)
class MultiStepReport:
    """A folder of step_<N> folders, checked step by step; a guarded run's folder adds its trend."""

    directory: str
    """The run folder holding the step_<N> folders."""
    steps: tuple[Report, ...]
    """One report per step, by step number (none for a guarded run the guard never dumped)."""
    summary: tuple[StepSummary, ...]
    """One summary row per step, in the order of `steps`."""
    guard_trend: GuardTrend | None = None
    """The guard's trend when the folder is a guarded run's (it holds guard_trend.jsonl); else None."""
    report_version: int = REPORT_VERSION
    """The JSON report's shape version (REPORT_VERSION)."""
