"""GA301-GA303: did every rank apply one coefficient, the one the true norm asks for?"""

from __future__ import annotations

import math

from ..diagnosis import diagnose_step
from ..engine.measure import StepMeasurements
from ..model import StepDump
from ..norms import relative_difference
from .base import AuditOptions, CheckResult, Hit, Skip, num, ranks_named

SOURCE_TEXT = {
    "gradients": "measured from the pre- and post-clip gradients",
    "reported": "as reported",
    "reported_norm": "derived from the reported norm",
}


def _clusters(values: list[tuple[int, float]], rtol: float) -> list[list[tuple[int, float]]]:
    """Ranks grouped by coefficient: consecutive sorted values within `rtol` of the group's first."""
    groups: list[list[tuple[int, float]]] = []
    for rank, value in sorted(values, key=lambda rv: (rv[1], rv[0])):
        if groups and relative_difference(groups[-1][0][1], value) <= rtol:
            groups[-1].append((rank, value))
        else:
            groups.append([(rank, value)])
    return groups


def coefficients_differ(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnose_step(step, m)
    known = [(d.rank, d.applied_coef) for d in diagnosis.ranks.values() if d.applied_coef is not None]
    if len(known) < 2:
        return Skip(reason="fewer than two ranks have a known applied coefficient")
    if any(math.isnan(c) for _, c in known):
        known = [(r, c) for r, c in known if not math.isnan(c)]
        if len(known) < 2:
            return Skip(reason="the applied coefficients are nan (a nonfinite norm, see GA401)")
    groups = _clusters(known, diagnosis.rtol)
    if len(groups) <= 1:
        return ()
    majority = max(groups, key=len)
    outliers = (
        [rv for g in groups if g is not majority for rv in g] if len(majority) > len(known) / 2 else known
    )
    described = "; ".join(
        f"{ranks_named(r for r, _ in g)}: {num(g[0][1])}" for g in sorted(groups, key=lambda g: g[0][0])
    )
    values = [c for _, c in known]
    return (
        Hit(
            message=f"ranks applied {len(groups)} different clip coefficients to one update ({described})",
            ranks=tuple(r for r, _ in outliers),
            evidence={
                "min_clip_coef": min(values),
                "max_clip_coef": max(values),
                "num_distinct": len(groups),
            },
        ),
    )


def coefficient_vs_expected(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnose_step(step, m)
    if diagnosis.max_norm is None:
        return Skip(reason="no rank recorded max_norm (no clip record in the dump)")
    if diagnosis.true_norm is None:
        return Skip(reason=f"the true global norm is unknown: {diagnosis.true_norm_note}")
    if not math.isfinite(diagnosis.true_norm):
        return Skip(
            reason=f"the true global norm is {num(diagnosis.true_norm)} (nonfinite gradients, see GA401)"
        )
    known = [d for d in diagnosis.ranks.values() if d.applied_coef is not None]
    if not known:
        return Skip(reason="no rank dumped post-clip gradients, a clip coefficient or a reported norm")
    single = [d for d in known if d.num_clip_calls <= 1]
    if not single:
        return Skip(
            reason="every rank clipped several times before the step (see GA501): no one coefficient to compare"
        )
    wrong = [d for d in single if relative_difference(d.applied_coef, d.expected_coef) > diagnosis.rtol]
    if not wrong:
        return ()
    alike: dict[tuple[str, str | None], list[int]] = {}
    for d in wrong:
        alike.setdefault((num(d.applied_coef), d.coef_source), []).append(d.rank)
    details = "; ".join(
        f"{ranks_named(ranks)} applied {coef} ({SOURCE_TEXT.get(source, source)})"
        for (coef, source), ranks in sorted(alike.items(), key=lambda kv: kv[1][0])[:6]
    )
    if len(alike) > 6:
        details += f"; and {len(alike) - 6} more coefficients"
    return (
        Hit(
            message=(
                f"the true global norm {num(diagnosis.true_norm)} with max_norm {num(diagnosis.max_norm)} asks for "
                f"coefficient {num(diagnosis.expected_coef)}, but {details}"
            ),
            ranks=tuple(d.rank for d in wrong),
            evidence={
                "true_norm": diagnosis.true_norm,
                "max_norm": diagnosis.max_norm,
                "expected_clip_coef": diagnosis.expected_coef,
                "applied_clip_coef": wrong[0].applied_coef,
                "rtol": diagnosis.rtol,
            },
        ),
    )


def post_clip_norm(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnose_step(step, m)
    if diagnosis.max_norm is None:
        return Skip(reason="no rank recorded max_norm (no clip record in the dump)")
    if diagnosis.post_clip_norm is None:
        return Skip(reason="post-clip gradients (grad_clipped) were not dumped for every piece")
    if not math.isfinite(diagnosis.post_clip_norm):
        return Skip(
            reason=f"the post-clip norm is {num(diagnosis.post_clip_norm)} (nonfinite gradients, see GA401)"
        )
    limit = diagnosis.max_norm * (1 + diagnosis.rtol)
    if diagnosis.post_clip_norm <= limit:
        return ()
    return (
        Hit(
            message=(
                f"after clipping, the global norm is {num(diagnosis.post_clip_norm)}, above max_norm "
                f"{num(diagnosis.max_norm)} (ratio {num(diagnosis.post_clip_norm / diagnosis.max_norm)})"
            ),
            ranks=tuple(step.ranks_present),
            evidence={
                "post_clip_norm": diagnosis.post_clip_norm,
                "max_norm": diagnosis.max_norm,
                "rtol": diagnosis.rtol,
            },
        ),
    )
