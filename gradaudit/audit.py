"""Auditing a step folder (or a folder of steps), stage by stage:

    load_step (dumpfile) -> measure_step (measure) -> analyse (analysis) -> build_report (checks, report)

`audit_step_dir` loads one step and assembles the stages for it (with a reference, `judge_updates`
reads the tensors a second time, for the update judgements); `analyse` and `build_report` are pure
given their inputs; `audit_folder` finds the step folders (and a guarded run's trend).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from .analysis.diagnosis import StepDiagnosis, diagnose
from .analysis.hypotheses import CORRECT, LOCAL_ONLY
from .checks.base import Analysis, AuditOptions, num, ranks_named
from .checks.fixes import stack_of, with_fixes
from .checks.reference import reference_comparisons
from .checks.registry import CAUSES_FIRST, CLIPPING_CODES, run_checks
from .dumpfile.dump import StepDump
from .errors import StepFolderError
from .live.trend import TREND_FILE, read_trend
from .live.writing import ATTEMPT_PREFIX, FULL_CAPTURES
from .measure.measure import measure_step, overflow_notes
from .model import StepFacts
from .norms import norm_name
from .report.model import (
    Environment,
    Finding,
    MeshShape,
    MultiStepReport,
    NonfiniteCounts,
    NotChecked,
    RankRow,
    Report,
    Severity,
    StepSummary,
    TopologySummary,
    first_call_numbers,
)
from .steptable import StepMeasurements, StepTable
from .version import __version__

if TYPE_CHECKING:
    from .analysis.coverage import ParamCoverage
    from .analysis.updates import UpdateJudgement
    from .dumpfile.loader import LoadFiles
    from .dumpfile.reader import TensorReader
    from .report.model import GuardTrend
    from .report.param_shares import SumSqShares

Progress = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class Shares:
    """What the audit calls instead of loading and measuring alone (under torchrun: scaleout.scaled_out)."""

    load_files: LoadFiles
    """Loads this process's share of the rank files and returns every process's."""
    measure: Callable[..., StepMeasurements]
    """A drop-in for `measure.measure_step` (scaleout.measure_share): measures this process's share of
    the parameters and returns the merged measurements."""


def verdict(
    diagnosis: StepDiagnosis, findings: tuple[Finding, ...], not_checked: tuple[NotChecked, ...]
) -> str:
    """One sentence: the true norm (and the moment it is of), the expected coefficient and the
    principal finding; or that clipping was right, or could not be checked and why."""
    name = norm_name(diagnosis.norm_type)
    moment = f" {diagnosis.moment}" if diagnosis.moment else ""
    if diagnosis.true_norm is not None:
        head = f"True global {name} {num(diagnosis.true_norm)}{moment}"
        coefficient = f"expected clip coefficient {num(diagnosis.expected_coef)}"
    elif diagnosis.norm_lower_bound is not None:
        head = f"True global {name} at least {num(diagnosis.norm_lower_bound)}{moment} ({diagnosis.true_norm_note})"
        coefficient = f"expected clip coefficient at most {num(diagnosis.coef_upper_bound)}"
    else:
        head, coefficient = f"The true global norm is unknown ({diagnosis.true_norm_note})", ""
    if coefficient and diagnosis.max_norm is not None:
        head += f" with max_norm {num(diagnosis.max_norm)}: {coefficient}"
    serious = [f for f in findings if f.severity is not Severity.INFO]
    if [f.code for f in serious] == ["GA206"]:
        return f"{head}. Clipping not checked: {serious[0].evidence['reason']}."
    if serious:
        rank_of = {code: i for i, code in enumerate(CAUSES_FIRST)}
        principal = min(serious, key=lambda f: (rank_of.get(f.code, len(rank_of)), f.sort_key))
        where = f" on {ranks_named(principal.ranks)}" if principal.ranks else ""
        others = len(serious) - 1
        more = f" (and {others} more finding{'s' if others > 1 else ''})" if others else ""
        return f"{head}. {principal.code}: {principal.title}{where}{more}."
    undecided = {n.code: n for n in not_checked if n.code in CLIPPING_CODES}
    if "GA201" in undecided and "GA302" in undecided:
        return f"{head}. Clipping not checked: {undecided['GA201'].reason}."
    if "GA201" in undecided:
        return (
            f"{head}. Every rank applied the expected coefficient, but which norm clipping used could not be "
            f"checked: {undecided['GA201'].reason}."
        )
    if undecided:
        return (
            f"{head}. No problem found, but {', '.join(sorted(undecided))} could not be checked (see below)."
        )
    clean = f"{head}. Clipping used the true global norm and every rank applied the expected coefficient"
    if _local_equals_global(diagnosis):
        return (
            f"{clean}; every rank holds every gradient here, so a local-only norm would have been the same: "
            "this step cannot tell whether the clipping code reduces across ranks."
        )
    return f"{clean}."


def _local_equals_global(diagnosis: StepDiagnosis) -> bool:
    """Whether every rank's norm matched the true one and, as well, its own pieces only (DDP, one rank)."""
    matches = [d.reported_match or d.implied_match for d in diagnosis.ranks.values()]
    return bool(matches) and all(
        m is not None
        and m.candidate is not None
        and m.candidate.hypothesis == CORRECT
        and LOCAL_ONLY in m.coinciding
        for m in matches
    )


def _rank_rows(inputs: Analysis) -> tuple[RankRow, ...]:
    step, diagnosis = inputs.step, inputs.diagnosis
    counts = _grad_counts_by_rank(inputs.table)
    from .checks.valueclip import gate

    by_value = gate(inputs) is not None  # element-wise clipping applies no coefficient to report
    per_param = inputs.param_coefficients
    mixed = set(per_param.mixed_ranks) if per_param is not None and per_param.differ else set()
    rows = []
    for rank in step.ranks_present:
        d = diagnosis.ranks[rank]
        nan, posinf, neginf = counts.get(rank, (0, 0, 0))
        detail = d.detail + (" (logging bug: see GA205)" if d.logging_bug else "")
        if rank in mixed:  # a mean over parameters that received different coefficients is none of them
            detail += "; its parameters received different coefficients (GA304)"
        if by_value:
            detail = "clipped element-wise (GA506): no norm or coefficient to match"
        rows.append(
            RankRow(
                rank=rank,
                local_norm=math.nan if d.local_norm is None else d.local_norm,
                reported_norm=d.reported_norm,
                applied_clip_coef=None if by_value or rank in mixed else d.applied_coef,
                applied_coef_source=None if by_value or rank in mixed else d.coef_source,
                diagnosis=None if by_value or d.hypothesis is None else d.hypothesis.text,
                diagnosis_detail=detail,
                share_of_squared_norm=d.share_of_squared_norm,
                nonfinite=NonfiniteCounts(nan=nan, posinf=posinf, neginf=neginf),
            )
        )
    return tuple(rows)


def _grad_counts_by_rank(table: StepTable) -> dict[int, tuple[int, int, int]]:
    """Rank -> (nan, +inf, -inf) counts of its gradient pieces (ranks with any nonfinite value)."""
    counts = table.grad.counts
    if not counts.any():
        return {}
    import numpy as np

    held = np.bincount(table.rank)
    ranks = np.flatnonzero(held)
    by_rank = [np.bincount(table.rank, weights=column, minlength=held.size)[ranks] for column in counts.T]
    totals = np.stack(by_rank, axis=1).astype(np.int64)
    return {r: (a, b, c) for r, (a, b, c) in zip(ranks.tolist(), totals.tolist(), strict=True)}


def _environment(step: StepFacts) -> Environment:
    dumps = [step.ranks[r] for r in step.ranks_present]

    def distinct(values: Iterable[str | None]) -> tuple[str, ...]:
        return tuple(sorted({v for v in values if v}))

    return Environment(
        auditor_version=__version__,
        dump_versions=distinct(d.gradaudit_version for d in dumps),
        torch_versions=distinct(d.torch_version for d in dumps),
        hosts=distinct(d.host for d in dumps),
        modes=tuple(sorted({d.mode for d in dumps})),
        world_size=step.world_size,
        run_ids=distinct(d.run_id for d in dumps),
    )


def _topology(step: StepFacts) -> TopologySummary:
    topo = step.topology
    mesh = topo.mesh
    return TopologySummary(
        groups={name: tuple(tuple(g) for g in lists) for name, lists in sorted(topo.groups.items())},
        mesh=None if mesh is None else MeshShape(shape=tuple(mesh.shape), axis_names=tuple(mesh.axis_names)),
        norm_group=topo.norm_group,
    )


def command_for(directory: str, options: AuditOptions) -> str:
    parts = ["gradaudit", "check", directory]
    if options.reference is not None:
        parts += ["--reference", options.reference]
    for flag, tolerance in (("--rtol", options.rtol), ("--atol", options.atol)):
        if tolerance is not None:
            parts += [flag, f"{tolerance:g}"]
    if options.allow_incomplete_ranks:
        parts += ["--allow-incomplete-ranks"]
    return " ".join(shlex.quote(p) for p in parts)


def judge_updates(
    step: StepDump, reference: StepDump, m: StepMeasurements, reader: TensorReader, options: AuditOptions
) -> Mapping[str, UpdateJudgement]:
    """The second, dense reading pass of a check with a reference: the next weights that differ from
    the reference while the gradients agree, judged through the optimizer (GA603 and GA604 read it)."""
    from .analysis.updates import judge_updates as judged
    from .analysis.updates import updates_to_judge
    from .measure.reference import dense_updates

    rtol, atol = options.rtol, options.atol
    asked = updates_to_judge(m, reference.params, rtol=rtol, atol=atol)
    return judged(m, dense_updates(step, reference, reader, asked), rtol=rtol, atol=atol)


def analyse(
    step: StepFacts,
    m: StepMeasurements,
    *,
    coverage: Mapping[str, ParamCoverage],
    update_judgements: Mapping[str, UpdateJudgement],
) -> Analysis:
    """The analysis stage: what the measured numbers mean, once per step, for every check (pure).
    `coverage`: who holds which element of each parameter (`coverage_by_param` of the loaded step's
    pieces; the guard's from its ownership groups). `update_judgements`: judge_updates' result with a
    reference, {} without one."""
    from .analysis.norm_input import norm_input_of
    from .analysis.param_coefs import param_coefficients
    from .analysis.valueclip import value_clipping

    table = m.table
    diagnosis = diagnose(step, norm_input_of(step, m, table))
    return Analysis(
        step=step,
        measurements=m,
        table=table,
        diagnosis=diagnosis,
        coverage=coverage,
        update_judgements=update_judgements,
        value_clipping=value_clipping(step, table),
        param_coefficients=param_coefficients(step, diagnosis, table),
    )


def build_report(
    inputs: Analysis,
    options: AuditOptions,
    *,
    command: str = "",
    warnings: tuple[str, ...] = (),
) -> Report:
    """The check and report stages: every check on the analysed step, and the Report (pure)."""
    findings, not_checked = run_checks(inputs, options)
    findings = with_fixes(findings, stack_of(inputs.step))
    step, m, diagnosis = inputs.step, inputs.measurements, inputs.diagnosis
    clip = step.clip
    return Report(
        step=step.step,
        world_size=step.world_size,
        ranks_present=step.ranks_present,
        missing_ranks=step.missing_ranks,
        norm_type=m.norm_type,
        max_norm=None if clip is None else clip.max_norm,
        global_norm=diagnosis.true_norm,
        expected_clip_coef=diagnosis.expected_coef,
        ranks=_rank_rows(inputs),
        findings=findings,
        not_checked=not_checked,
        verdict=verdict(diagnosis, findings, not_checked),
        environment=_environment(step),
        topology=_topology(step),
        reference=reference_comparisons(m, options),
        command=command,
        warnings=tuple(step.warnings) + tuple(warnings) + _trigger_notes(step),
        sum_sq_shares=_spike_shares(inputs),
    )


def _spike_shares(inputs: Analysis) -> SumSqShares | None:
    """Of a step the guard dumped at a spike of its true norm: the parameters holding most of Σg²."""
    from .report.param_shares import SPIKE_TRIGGER, sum_sq_shares

    step = inputs.step
    spiked = [step.ranks[r] for r in step.ranks_present if step.ranks[r].trigger == SPIKE_TRIGGER]
    if not spiked:
        return None
    note = next((d.trigger_note for d in spiked if d.trigger_note), None) or ""
    return sum_sq_shares(inputs.table, note=note)


def _trigger_notes(step: StepFacts) -> tuple[str, ...]:
    """A dump gradaudit.guard wrote on its own says so: its pieces are ownership groups, not parameters
    (but those of its dump of a step whose replicas differ, "guard.params": live/spike_dump.py)."""
    if not any(step.ranks[r].trigger == "guard" for r in step.ranks_present):
        return ()
    notes = dict.fromkeys(n for r in step.ranks_present if (n := step.ranks[r].trigger_note))
    head = f"guard-triggered: gradaudit.guard wrote step {step.step} when it found its clipping wrong"
    if any(step.ranks[r].capture_api != "guard.params" for r in step.ranks_present):
        head += (
            "; each piece is one rank's ownership group (its shards, or what it holds of a replicated group), "
            "not a parameter"
        )
    return (head, *(f"guard-triggered: {note}" for note in notes))


def audit_step_dir(
    path: str | Path,
    options: AuditOptions,
    *,
    progress: Progress | None = None,
    shares: Shares | None = None,
) -> Report:
    """Audit one step_<N> folder (with options.reference, against that reference step): the stages
    assembled for the loaded step (with a reference, `judge_updates` reads the tensors a second time)."""
    from .analysis.coverage import coverage_by_param
    from .dumpfile import TensorReader, load_step
    from .dumpfile.loader import gc_paused
    from .measure.leftout import checked_params

    load_files = None if shares is None else shares.load_files
    step = load_step(path, allow_incomplete=options.allow_incomplete_ranks, load_files=load_files)
    reference, warnings = _reference_for(step, options)
    with gc_paused():  # see gc_paused: a many-rank step is millions of live objects
        with TensorReader(step, reference) as reader:
            measure = measure_step if shares is None else shares.measure
            m = measure(step, reader, reference=reference, progress=progress, params=checked_params(step))
            judgements = {} if reference is None else judge_updates(step, reference, m, reader, options)
        inputs = analyse(step, m, coverage=coverage_by_param(step), update_judgements=judgements)
        warnings = tuple(warnings) + overflow_notes(inputs.table)
        return build_report(inputs, options, command=command_for(step.directory, options), warnings=warnings)


def _reference_for(step: StepDump, options: AuditOptions) -> tuple[StepDump | None, tuple[str, ...]]:
    """The reference step matching `step`: the reference folder itself, or its step_<N> child with the same N."""
    from .dumpfile import find_step_dirs, load_step

    if options.reference is None:
        return None, ()
    candidates = find_step_dirs(options.reference)
    if len(candidates) == 1 and Path(candidates[0]) == Path(options.reference):
        reference = load_step(options.reference)
    else:
        matching = [c for c in candidates if c.name == f"step_{step.step}"]
        if not matching:
            raise StepFolderError(
                f"{options.reference}: holds no step_{step.step} folder to compare step {step.step} with; "
                "point --reference at the reference step folder"
            )
        reference = load_step(matching[0])
    warnings = []
    if reference.step != step.step:
        warnings.append(f"the reference is step {reference.step}, the checked dump step {step.step}")
    if reference.world_size != 1:
        warnings.append(f"the reference has world size {reference.world_size}; an unsharded reference has 1")
    return reference, tuple(warnings)


def summarize(report: Report, directory: str) -> StepSummary:
    numbers = first_call_numbers(report)
    return StepSummary(
        step=report.step,
        directory=directory,
        global_norm=numbers.true_norm,
        reported_norm=numbers.reported_norm,
        expected_clip_coef=numbers.expected_clip_coef,
        num_errors=sum(f.severity is Severity.ERROR for f in report.findings),
        num_warnings=sum(f.severity is Severity.WARNING for f in report.findings),
        codes=tuple(sorted({f.code for f in report.findings})),
    )


def run_step_dirs(path: str | Path) -> list[Path]:
    """The step folders of `path` (see find_step_dirs), with a run folder's full/step_<N> (the guard's
    full captures) and those of its restarts (attempt_<N>/) among its own step_<N>, by step number;
    none for a guarded run's folder that holds only the trend (the guard dumps only what it finds wrong)."""
    from .dumpfile import find_step_dirs
    from .dumpfile.writer import RANK_FILE_SUFFIX, STEP_DIR_PREFIX

    path = Path(path)
    own = find_step_dirs(path)
    if any(path.glob(f"*{RANK_FILE_SUFFIX}")):
        return own
    attempts = sorted(
        (int(d.name.removeprefix(ATTEMPT_PREFIX)), d)
        for d in path.glob(f"{ATTEMPT_PREFIX}*")
        if d.name.removeprefix(ATTEMPT_PREFIX).isdigit() and d.is_dir()
    )
    steps = [(1, d) for d in own if d != path]
    for number, root in ((1, path), *attempts):
        if root != path:
            steps += [(number, d) for d in find_step_dirs(root) if d != root]
        full = root / FULL_CAPTURES
        steps += [(number, d) for d in find_step_dirs(full) if d != full] if full.is_dir() else []
    if not steps or (len(steps) == len(own) and not attempts):
        return [d for d in own if d != path] if (path / TREND_FILE).is_file() else own
    return [
        d for _, _, d in sorted((int(d.name.removeprefix(STEP_DIR_PREFIX)), number, d) for number, d in steps)
    ]


def audit_folder(
    path: str | Path,
    options: AuditOptions,
    *,
    progress: Progress | None = None,
    shares: Shares | None = None,
) -> Report | MultiStepReport:
    """A step folder gives a Report; a folder of step_<N> folders a MultiStepReport, step by step
    (`progress` sees one count over all of them), with the guard's trend for a guarded run's folder,
    read first (a damaged trend stops the check before any audit)."""
    step_dirs = run_step_dirs(path)
    if step_dirs == [Path(path)]:
        return audit_step_dir(path, options, progress=progress, shares=shares)
    trend = read_guard_trend(path, step_dirs)
    reports = [
        audit_step_dir(
            directory, options, progress=_over_steps(progress, index, len(step_dirs)), shares=shares
        )
        for index, directory in enumerate(step_dirs)
    ]
    return MultiStepReport(
        directory=str(path),
        steps=tuple(reports),
        summary=tuple(summarize(r, str(d)) for d, r in zip(step_dirs, reports, strict=True)),
        guard_trend=trend,
    )


def read_guard_trend(path: str | Path, step_dirs: Sequence[Path]) -> GuardTrend | None:
    """The trend of a guarded run's folder (one that holds the guard's trend and is no step folder;
    None for any other), its failing steps matched with the guard's dumps among `step_dirs`."""
    from .dumpfile.writer import RANK_FILE_SUFFIX, STEP_DIR_PREFIX
    from .report.model import TrendStep, guard_trend

    path = Path(path)
    file = path / TREND_FILE
    if not file.is_file() or any(path.glob(f"*{RANK_FILE_SUFFIX}")):
        return None
    dumps: dict[int, str] = {}
    full: list[str] = []
    for directory in step_dirs:
        number = directory.name.removeprefix(STEP_DIR_PREFIX)
        if directory.parent == path / FULL_CAPTURES:
            full.append(str(directory))
        elif directory.parent == path and number.isdigit():
            dumps[int(number)] = str(directory)
    trend = read_trend(file)
    names = [f.name for f in fields(TrendStep) if f.name != "dump"]  # the trend line's, by name
    steps = (TrendStep(**{name: getattr(line, name) for name in names}) for line in trend.lines)
    return guard_trend(
        steps, file=str(file), dumps=dumps, full_captures=full, num_unread=trend.num_unread, notes=trend.notes
    )


def _over_steps(progress: Progress | None, index: int, num_steps: int) -> Progress | None:
    """Step `index`'s parameter count as part of one count over the folder's `num_steps` steps, each
    taken to have as many parameters as this one (the steps of a run hold the same model)."""
    if progress is None:
        return None

    def advance(done: int, total: int) -> None:
        progress(index * total + done, num_steps * total)

    return advance
