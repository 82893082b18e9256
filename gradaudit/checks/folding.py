"""Many findings of one code fold into one: a report stays proportional to what is wrong, not to how
many parameters a dump lists (a 30 MB table of 10^6 parameters, 4 of them held, gave 10^6 GA103 findings)."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Hit, count, ranks_named

MAX_FINDINGS_PER_CODE = 100
"""Findings one check reports in full; the rest fold into one more. Rank lists fold into ranges
already (render/fold.py folds the per-rank rows the same way for the human renderers)."""
MAX_FOLDED_PARAMS_LISTED = 10
"""Parameter names a folded finding lists (its evidence counts them all)."""


def fold_hits(hits: Sequence[Hit]) -> tuple[Hit, ...]:
    """`hits` unchanged when at most MAX_FINDINGS_PER_CODE, else the first MAX_FINDINGS_PER_CODE - 1
    (in report order: ranks, then parameters, then message) and one hit standing for all the others:
    their ranks (all of them), their first parameters, and counts of both in its evidence."""
    if len(hits) <= MAX_FINDINGS_PER_CODE:
        return tuple(hits)
    ordered = sorted(
        hits, key=lambda h: (tuple(sorted(set(h.ranks))), tuple(sorted(set(h.params))), h.message)
    )
    kept, rest = ordered[: MAX_FINDINGS_PER_CODE - 1], ordered[MAX_FINDINGS_PER_CODE - 1 :]
    ranks = sorted({r for hit in rest for r in hit.ranks})
    params = sorted({p for hit in rest for p in hit.params})
    listed = params[:MAX_FOLDED_PARAMS_LISTED]
    named = f" ({', '.join(listed)}{', …' if len(params) > len(listed) else ''})" if listed else ""
    on_ranks = f" on {ranks_named(ranks)}" if ranks else ""
    folded = Hit(
        message=(
            f"{count(len(rest), 'more finding')} of this code, folded into one: "
            f"{count(len(params), 'parameter')}{named}{on_ranks}; the first of them: {rest[0].message}"
        ),
        ranks=tuple(ranks),
        params=tuple(listed),
        evidence={"folded_findings": len(rest), "folded_params": len(params)},
    )
    return (*kept, folded)
