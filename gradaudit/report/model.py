"""The result of auditing a step: findings and per-rank rows, as plain frozen values for the renderers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from ..model import TensorKind

REPORT_VERSION = 2
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
    severity: Severity
    title: str
    message: str
    ranks: tuple[int, ...] = ()
    params: tuple[str, ...] = ()
    evidence: Mapping[str, Number | str | None] = field(default_factory=dict)
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
    title: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class NonfiniteCounts:
    nan: int = 0
    posinf: int = 0
    neginf: int = 0

    @property
    def total(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass(frozen=True, kw_only=True)
class RankRow:
    """One rank's line in the report."""

    rank: int
    local_norm: float
    """Norm of this rank's own pieces (pre-clip), as a local-only clip would compute it."""
    reported_norm: float | None
    applied_clip_coef: float | None
    applied_coef_source: str | None = None
    """"gradients" (from pre/post-clip tensors), "reported", or None when unknown."""
    diagnosis: str | None = None
    """The hypothesis code that best explains the reported norm: "correct", "local_only",
    "replicas_double_counted", "wrong_group:<name>", "loss_scaled:<hypothesis>", "unexplained", or None."""
    diagnosis_detail: str = ""
    share_of_squared_norm: float = 0.0
    """This rank's contribution to the squared global norm (replicas attributed to their lowest rank)."""
    nonfinite: NonfiniteCounts = field(default_factory=NonfiniteCounts)


@dataclass(frozen=True, kw_only=True)
class ParamComparison:
    """One parameter compared with the unsharded reference (`--reference`)."""

    param: str
    kind: TensorKind
    """The tensor kind compared: "grad", "grad_clipped", "param_after"."""
    max_abs_error: float
    max_rel_error: float
    atol: float
    rtol: float
    within_tolerance: bool


@dataclass(frozen=True, kw_only=True)
class Environment:
    """Fingerprint of the run: which versions wrote and audited the dump, on which hosts, in which mode."""

    auditor_version: str = ""
    """The gradaudit version that made this report."""
    dump_versions: tuple[str, ...] = ()
    """The gradaudit versions that wrote the rank files (one, unless the files were mixed)."""
    torch_versions: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    """Capture modes of the rank files: "full" (tensors) and/or "stats" (statistics only)."""
    world_size: int | None = None
    run_ids: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class TopologySummary:
    """The process groups the dump recorded: name -> rank lists, the device mesh, the norm's group."""

    groups: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    mesh: MeshShape | None = None
    norm_group: str | None = None


@dataclass(frozen=True, kw_only=True)
class Report:
    """Everything a renderer needs; built by the audit, never mutated."""

    step: int
    world_size: int
    ranks_present: tuple[int, ...]
    missing_ranks: tuple[int, ...]
    norm_type: float | None
    max_norm: float | None
    global_norm: float | None
    expected_clip_coef: float | None
    ranks: tuple[RankRow, ...]
    findings: tuple[Finding, ...]
    not_checked: tuple[NotChecked, ...] = ()
    verdict: str = ""
    """One sentence: the principal finding, or that clipping was right."""
    environment: Environment = field(default_factory=Environment)
    topology: TopologySummary = field(default_factory=TopologySummary)
    reference: tuple[ParamComparison, ...] = ()
    command: str = ""
    """The command line that reproduces this report."""
    warnings: tuple[str, ...] = ()
    report_version: int = REPORT_VERSION

    @property
    def worst_severity(self) -> Severity | None:
        return min((f.severity for f in self.findings), key=lambda s: s.rank, default=None)


@dataclass(frozen=True, kw_only=True)
class StepSummary:
    """One line of the multi-step table: reported vs true norm per step."""

    step: int
    directory: str
    global_norm: float | None
    reported_norm: float | None
    expected_clip_coef: float | None
    num_errors: int
    num_warnings: int
    codes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class MultiStepReport:
    """A folder of step_<N> folders, checked step by step."""

    directory: str
    steps: tuple[Report, ...]
    summary: tuple[StepSummary, ...]
    report_version: int = REPORT_VERSION
