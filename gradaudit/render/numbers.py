"""How the renderers show numbers (floats, nonfinite values, coefficients, counts, rank lists) and the
orderings and groupings of report rows that all of them share."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from ..ranksets import compact_ranks
from ..report.model import Finding, NonfiniteCounts, ParamComparison, RankRow, Severity

SIGNIFICANT_DIGITS = 6
MISSING = "-"
"""What a table shows for a value that is not known (JSON uses null)."""

JsonScalar = int | float | str | bool | None


def fmt_float(value: float | None) -> str:
    """6 significant digits; `nan`, `inf`, `-inf` spelled out; None as "-"."""
    if value is None:
        return MISSING
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"  # also for -0.0
    return f"{value:.{SIGNIFICANT_DIGITS}g}"


def fmt_coef(value: float | None) -> str:
    """A clip coefficient: like fmt_float, but never rounded to "1" when it is not exactly 1.

    A coefficient of 0.9999996 did clip; showing "1" would hide that.
    """
    text = fmt_float(value)
    if text == "1" and value is not None and value != 1:
        return f"{float(value):.10g}"
    return text


def fmt_percent(fraction: float | None) -> str:
    """ "25.0%"; below 0.1% two significant digits ("0.0024%"), so that a large world's ranks do not
    all read 0.0%; exactly zero is "0.0%"."""
    if fraction is None:
        return MISSING
    if not math.isfinite(fraction):
        return fmt_float(fraction)
    percent = fraction * 100
    if 0 < abs(percent) < 0.05:
        return f"{percent:.2g}%"
    return f"{percent:.1f}%"


def fmt_ranks(ranks: Iterable[int]) -> str:
    """Sorted ranks with consecutive runs collapsed: (0, 1, 2, 3, 7, 9, 10) -> "0-3, 7, 9-10"."""
    return compact_ranks(ranks) or MISSING


def fmt_steps_named(steps: Sequence[int]) -> str:
    """ "step 7" or "steps 1-3, 7"."""
    return f"{'step' if len(set(steps)) == 1 else 'steps'} {fmt_ranks(steps)}"


def fmt_nonfinite(counts: NonfiniteCounts) -> str:
    """ "0", or the nonzero counts: "2 nan, 1 -inf"."""
    if counts.total == 0:
        return "0"
    labelled = ((counts.nan, "nan"), (counts.posinf, "+inf"), (counts.neginf, "-inf"))
    return ", ".join(f"{n} {label}" for n, label in labelled if n)


def fmt_finding_counts(findings: Sequence[Finding]) -> str:
    """ "2 errors, 1 info", or "no findings"."""
    parts = []
    for severity in (Severity.ERROR, Severity.WARNING, Severity.INFO):
        n = sum(f.severity is severity for f in findings)
        if n:
            word = severity.value if n == 1 or severity is Severity.INFO else severity.value + "s"
            parts.append(f"{n} {word}")
    return ", ".join(parts) if parts else "no findings"


def fmt_value(value: object) -> str:
    """An evidence value for a human: numbers formatted, strings as they are (the caller escapes them)."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return fmt_float(float(value))
    return str(value)


def json_number(value: object) -> JsonScalar:
    """A value for JSON: nonfinite floats become "nan"/"inf"/"-inf" so the output stays valid JSON.

    numpy and other registered numeric types are converted to plain int/float.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number):
            return number
        return fmt_float(number)
    raise TypeError(f"cannot put {type(value).__name__} into a report; use a number, a string or None")


def reference_worst_first(comparisons: Sequence[ParamComparison]) -> list[ParamComparison]:
    """Failures first, then by relative then absolute error, largest (and nan) first; ties by name."""

    def badness(value: float) -> float:
        return math.inf if math.isnan(value) else value

    return sorted(
        comparisons,
        key=lambda c: (
            c.within_tolerance,
            -badness(c.max_rel_error),
            -badness(c.max_abs_error),
            c.param,
            c.kind,
        ),
    )


def unsaid_diagnosis_groups(
    rows: Sequence[RankRow], findings: Sequence[Finding]
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(diagnosis, detail, ranks) for each distinct explanation that no finding's message already says
    (each is said once), in order of first rank.

    Ranks whose explanations differ only in their numbers share one sentence (`fold_sentences`), so
    that the explanation is said once, with a rank range, however many ranks it covers.
    """
    from ..report.sentences import fold_sentences

    by_diagnosis: dict[str, list[tuple[int, str]]] = {}
    for row in rows:
        if row.diagnosis_detail:
            by_diagnosis.setdefault(row.diagnosis or MISSING, []).append((row.rank, row.diagnosis_detail))
    groups = [
        (diagnosis, folded.text, folded.ranks)
        for diagnosis, items in by_diagnosis.items()
        for folded in fold_sentences(items)
        if not any(folded.text in f.message for f in findings)
    ]
    return sorted(groups, key=lambda g: min(g[2]))


def replica_owners(rows: Sequence[RankRow]) -> dict[int, int | None]:
    """Ranks whose pieces are all counted on another rank (no share of Σg² though a norm of their own:
    replicas, attributed to their lowest rank) -> that owner (the lowest rank with the same own norm and
    a share), or None when no single one is."""
    owners: dict[int, int | None] = {}
    for row in rows:
        if row.share_of_squared_norm == 0 and math.isfinite(row.local_norm) and row.local_norm > 0:
            owners[row.rank] = next(
                (
                    r.rank
                    for r in rows
                    if r.rank < row.rank
                    and r.share_of_squared_norm > 0
                    and fmt_float(r.local_norm) == fmt_float(row.local_norm)
                ),
                None,
            )
    return owners


def fmt_replica_of(owner: int | None) -> str:
    """What a replica rank's share cell says instead of "0.0%"."""
    return "replica, counted on a lower rank" if owner is None else f"copy of rank {owner}, counted there"


def diagnosis_label(diagnosis: str | None, ranks: Sequence[int], findings: Sequence[Finding]) -> str:
    """The diagnosis cell: a "correct" norm says which clip call or copy it is right for when a finding
    on those ranks says clipping was still wrong (GA501: several calls; GA601: drifted replicas)."""
    if diagnosis is None:
        return MISSING
    if not diagnosis.endswith("correct"):
        return diagnosis
    covered = set(ranks)
    for f in findings:
        if covered <= set(f.ranks):
            if f.code == "GA501":
                calls = f.evidence.get("num_calls")
                return f"{diagnosis} (last of {calls} calls)"
            if f.code == "GA601":
                return f"{diagnosis} (own drifted copy)"
    return diagnosis
