"""GA401-GA402: nonfinite gradient values, and ranks that disagree on skipping the step."""

from __future__ import annotations

from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, count, listing, ranks_named

MAX_ENTRIES_IN_MESSAGE = 8


def nonfinite_gradients(inputs: Analysis, options: AuditOptions) -> CheckResult:
    counts: dict[tuple[int, str], list[int]] = {}
    table = inputs.table
    grad = table.grad
    at = (grad.has & grad.counts.any(axis=1)).nonzero()[0]
    for rank, param, found in zip(
        table.rank[at].tolist(), table.param[at].tolist(), grad.counts[at].tolist(), strict=True
    ):
        entry = counts.setdefault((rank, table.param_names[param]), [0, 0, 0])
        for k in range(3):
            entry[k] += found[k]
    if not counts:
        return ()
    ranks = sorted({r for r, _ in counts})
    params = sorted({p for _, p in counts})
    first = ranks[0]
    first_params = sorted(p for r, p in counts if r == first)
    entries = [
        f"rank {r} {p}: {c[0]} nan, {c[1]} +inf, {c[2]} -inf"
        for (r, p), c in sorted(counts.items())[:MAX_ENTRIES_IN_MESSAGE]
    ]
    totals = [sum(c[i] for c in counts.values()) for i in range(3)]
    return (
        Hit(
            message=(
                f"nonfinite gradient values on {ranks_named(ranks)} in {count(len(params), 'parameter')}; they first "
                f"appear on rank {first} ({', '.join(first_params[:3])}{', ...' if len(first_params) > 3 else ''}). "
                + listing(entries, len(counts), "more rank/parameter pairs")
            ),
            ranks=tuple(ranks),
            params=tuple(params),
            evidence={
                "num_nan": totals[0],
                "num_posinf": totals[1],
                "num_neginf": totals[2],
                "first_rank": first,
            },
        ),
    )


def skip_disagreement(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    hits = []
    recorded = False
    for field_name, meaning in (
        ("found_inf", "found nonfinite gradients"),
        ("step_skipped", "skipped the optimizer step"),
    ):
        values = {
            rank: getattr(step.ranks[rank].clip, field_name)
            for rank in step.ranks_present
            if step.ranks[rank].clip is not None and getattr(step.ranks[rank].clip, field_name) is not None
        }
        recorded |= bool(values)
        yes = sorted(r for r, v in values.items() if v)
        no = sorted(r for r, v in values.items() if not v)
        if yes and no:
            minority = yes if len(yes) <= len(no) else no
            hits.append(
                Hit(
                    message=(
                        f"ranks disagree on whether they {meaning}: yes on {ranks_named(yes)}, no on "
                        f"{ranks_named(no)}; one logical update was applied by some ranks and not others"
                    ),
                    ranks=tuple(minority),
                    evidence={"field": field_name, "num_yes": len(yes), "num_no": len(no)},
                )
            )
    if not recorded:
        return Skip(reason="no rank recorded found_inf or step_skipped (no GradScaler or optimizer record)")
    return tuple(hits)
