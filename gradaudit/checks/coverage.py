"""GA100-GA103: is the step complete and consistent, and does every element have exactly one owner?"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, cast

from ..analysis.geometry import BoxTuple, Coverage, CoverageTooIntricate, coverage, region_boxes
from ..dumpfile.header import clipped, shown
from ..errors import StepFolderError
from ..measure.leftout import left_out_params
from ..model import FlatRange, ParamInfo, Region, StepDump, numel_of
from .base import (
    MAX_FINDINGS_PER_CODE,
    MAX_FOLDED_PARAMS_LISTED,
    AuditInputs,
    AuditOptions,
    CheckResult,
    Hit,
    Skip,
    ranks_named,
)

if TYPE_CHECKING:
    import numpy as np


def missing_ranks(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    step = inputs.step
    if not step.missing_ranks:
        return ()
    return (
        Hit(
            message=(
                f"{len(step.missing_ranks)} of {step.world_size} ranks have no file in {step.directory} "
                f"({ranks_named(step.missing_ranks)}); the other ranks are audited and the checks that "
                "need the missing ranks say they could not decide"
                + "".join(
                    f"; rank {rank}'s file is unreadable: {reason}"
                    for rank, reason in sorted(step.unreadable_ranks.items())
                )
            ),
            ranks=step.missing_ranks,
            evidence={"world_size": step.world_size, "num_missing": len(step.missing_ranks)},
        ),
    )


def metadata_disagreement(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    step = inputs.step
    hits = []
    for item in step.inconsistencies:
        by_value: dict[str, list[int]] = {}
        for rank, value in sorted(item.values.items()):
            by_value.setdefault(value, []).append(rank)
        described = "; ".join(
            f"{ranks_named(r)}: {v}" for v, r in sorted(by_value.items(), key=lambda kv: kv[1])
        )
        hits.append(
            Hit(
                message=f"ranks disagree on {item.what}: {described}",
                ranks=tuple(item.values),
                evidence={"what": item.what, "num_values": len(by_value)},
            )
        )
    return tuple(hits)


Layouts = dict[tuple[Region, ...], list[int]]
"""A parameter's distinct layouts (the regions of one piece) -> the ranks holding them."""

ParamCoverage = tuple[ParamInfo, Coverage, list[int], list[int]]
"""(the parameter, its coverage, ranks in overlaps, ranks holding it)."""


def layouts_by_param(step: StepDump) -> dict[str, Layouts]:
    """Parameter -> its distinct layouts (replicas merged) -> the ranks holding them, in one pass."""
    found: dict[str, Layouts] = {name: {} for name in step.params}
    for rank in step.ranks_present:
        for piece in step.ranks[rank].pieces:
            found.setdefault(piece.param, {}).setdefault(piece.regions, []).append(rank)
    return found


def _disjoint_flat_ranges(shape: tuple[int, ...], layouts: list[tuple[Region, ...]]) -> Coverage | None:
    """The coverage of single flat ranges none of which overlap another (a clean FSDP/ZeRO layout,
    the common case of a many-rank dump), from sorted arrays; None when that is not the case."""
    if any(len(regions) != 1 or type(regions[0]) is not FlatRange for regions in layouts):
        return None
    import numpy as np

    flats = cast(list[FlatRange], [regions[0] for regions in layouts])
    bounds = np.array([(f.start, f.stop) for f in flats], dtype=np.int64).reshape(-1, 2)
    return _disjoint_bounds(bounds, numel_of(shape))


def _param_coverage(shape: tuple[int, ...], holders: Layouts) -> tuple[Coverage, list[int]]:
    layouts = list(holders)
    disjoint = _disjoint_flat_ranges(shape, layouts)
    if disjoint is not None:
        return disjoint, []
    boxes: list[BoxTuple]
    flat = [r for regions in layouts for r in regions if isinstance(r, FlatRange)]
    if len(flat) == sum(len(regions) for regions in layouts):
        # Flat ranges are intervals of the flattened parameter: a 1-D sweep, O(k log k). Cut into boxes
        # of a 2-D parameter they would cost the rectangle sweep rows x columns (quadratic in k).
        shape = (numel_of(shape),)
        boxes = [
            ((r.start,), (r.numel,), tag)
            for tag, regions in enumerate(layouts)
            for r in regions
            if isinstance(r, FlatRange)
        ]
    else:
        boxes = [
            (offsets, sizes, tag)
            for tag, regions in enumerate(layouts)
            for region in regions
            for offsets, sizes in region_boxes(region, shape)
        ]
    result = coverage(boxes, shape)
    ranks = sorted({r for tag in result.overlapping_tags for r in holders[layouts[cast(int, tag)]]})
    return result, ranks


def coverage_by_param(step: StepDump) -> dict[str, ParamCoverage]:
    """Parameter -> (ParamInfo, Coverage, ranks in overlaps, ranks holding it). Needs the step only, not
    the measurements (the ownership map is metadata), so it also runs on headers alone."""
    flat = _flat_pieces_by_param(step)
    layouts: dict[str, Layouts] | None = None
    found: dict[str, ParamCoverage] = {}
    holders: dict[bytes, list[int]] = {}
    unheld: list[int] = []
    left_out = left_out_params(step)  # not checked (GA104): part of them is in no rank's file
    for name, info in step.params.items():
        if name in left_out:
            continue
        if name not in flat:  # held by no rank: all of it is a gap (most of a table listing 10^6)
            found[name] = (info, _all_gap(info), unheld, unheld)
            continue
        fast = _flat_param_coverage(info, flat[name], holders)
        if fast is not None:
            found[name] = fast
            continue
        if layouts is None:
            layouts = layouts_by_param(step)
        try:
            result, ranks = _param_coverage(info.global_shape, layouts[name])
        except CoverageTooIntricate as exc:
            raise StepFolderError(
                f"{step.directory}: the pieces of parameter {shown(name)} cannot be checked for overlaps and "
                f"gaps: {exc}"
            ) from None
        found[name] = (info, result, ranks, sorted({r for rs in layouts[name].values() for r in rs}))
    return found


FlatPieces: TypeAlias = "tuple[np.ndarray, np.ndarray, np.ndarray] | None"
"""A parameter's pieces as (starts, stops, ranks) when each is one flat range, else None."""


def _flat_pieces_by_param(step: StepDump) -> dict[str, FlatPieces]:
    """Every parameter's pieces as three integer arrays (no object per piece of a format-1.1 rank)."""
    import numpy as np

    from ..dumpfile.columnar import ParamIds

    ids = ParamIds(list(step.params))
    columns: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]] = []
    for rank in step.ranks_present:
        pieces = step.ranks[rank].columns
        rows, coords = pieces.rows, pieces.coords
        first = rows[:, 2]  # a box has at least two coordinates too: both reads stay inside
        flat = rows[:, 3] == 0
        flat[list(pieces.extras.regions)] = False  # not one region
        columns.append((ids.of(pieces), coords[first], coords[first + 1], flat, rank))
    if not columns:
        return {}
    param = np.concatenate([c[0] for c in columns])
    start = np.concatenate([c[1] for c in columns])
    stop = np.concatenate([c[2] for c in columns])
    is_flat = np.concatenate([c[3] for c in columns])
    ranks = np.concatenate([np.full(len(c[0]), c[4], dtype=np.int64) for c in columns])
    order = np.argsort(param, kind="stable")
    distinct, bounds = np.unique(param[order], return_index=True)
    bounds = np.append(bounds, order.size)
    names = list(ids.ids)
    found: dict[str, FlatPieces] = {}
    for k, param_id in enumerate(distinct.tolist()):
        chosen = order[bounds[k] : bounds[k + 1]]
        found[names[param_id]] = (
            (start[chosen], stop[chosen], ranks[chosen]) if is_flat[chosen].all() else None
        )
    return found


def _all_gap(info: ParamInfo) -> Coverage:
    return Coverage(num_gap_elements=info.numel, num_overlap_elements=0, overlapping_tags=frozenset())


def _flat_param_coverage(
    info: ParamInfo, pieces: FlatPieces, holders: dict[bytes, list[int]] | None = None
) -> ParamCoverage | None:
    """The coverage of a parameter held as flat ranges that overlap nowhere (identical ranges are
    replicas, one layout): the common case of a many-rank FSDP/ZeRO dump, from arrays; None when
    another case (the sweep names the overlaps)."""
    if pieces is None:
        return None
    import numpy as np

    starts, stops, ranks = pieces
    starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
    order = np.lexsort((stops, starts))  # the distinct (start, stop) rows, sorted: np.unique(axis=0)
    starts, stops = starts[order], stops[order]
    distinct = np.ones(starts.size, dtype=bool)
    distinct[1:] = (starts[1:] != starts[:-1]) | (stops[1:] != stops[:-1])
    bounds = np.stack([starts[distinct], stops[distinct]], axis=1)
    result = _disjoint_bounds(bounds, numel_of(info.global_shape))
    if result is None:
        return None
    distinct = np.unique(ranks)
    if holders is None:
        return info, result, [], distinct.tolist()
    key = distinct.astype(np.int64).tobytes()
    if key not in holders:  # one list for the parameters held by the same ranks (often all of them)
        holders[key] = distinct.tolist()
    return info, result, [], holders[key]


def _disjoint_bounds(bounds: np.ndarray, numel: int) -> Coverage | None:
    """Coverage of [start, stop) rows of `bounds` (distinct layouts) when none overlaps another."""
    import numpy as np

    bounds = bounds[bounds[:, 1] > bounds[:, 0]]
    bounds = bounds[np.argsort(bounds[:, 0], kind="stable")]
    if (bounds[1:, 0] < bounds[:-1, 1]).any():
        return None  # overlaps: the sweep names them
    covered = int((bounds[:, 1] - bounds[:, 0]).sum())
    return Coverage(num_gap_elements=numel - covered, num_overlap_elements=0, overlapping_tags=frozenset())


def ownership_overlap(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    hits = []
    for name, (info, result, ranks, _) in inputs.coverage.items():
        if result.num_overlap_elements:
            hits.append(
                Hit(
                    message=(
                        f"{result.num_overlap_elements} of {info.numel} elements of {name} are held by more than "
                        f"one piece that is not an identical replica ({ranks_named(ranks)}); those "
                        "elements would be counted twice in any norm"
                    ),
                    ranks=tuple(ranks),
                    params=(name,),
                    evidence={"num_overlap_elements": result.num_overlap_elements, "numel": info.numel},
                )
            )
    return tuple(hits)


def ownership_gap(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    step = inputs.step
    if step.missing_ranks:
        return Skip(
            reason=f"some ranks are missing ({ranks_named(step.missing_ranks)}); "
            "the elements they held cannot be located"
        )
    hits, unheld = [], []
    for name, (info, result, _, holders) in inputs.coverage.items():
        if not result.num_gap_elements:
            continue
        if not holders:
            unheld.append(info)
            continue
        hits.append(
            Hit(
                message=(
                    f"{result.num_gap_elements} of {info.numel} elements of {name} are held by no rank "
                    f"(held pieces are on {ranks_named(holders)}); their gradient is absent from every norm"
                ),
                ranks=tuple(holders),
                params=(name,),
                evidence={"num_gap_elements": result.num_gap_elements, "numel": info.numel},
            )
        )
    if len(hits) + len(unheld) > MAX_FINDINGS_PER_CODE:
        # One finding for the parameters no rank holds any of, not one each: a table may list 10^6.
        return (*hits, _unheld_params(unheld, len(step.params)))
    return (*hits, *(_unheld_param(info) for info in unheld))


def _unheld_param(info: ParamInfo) -> Hit:
    return Hit(
        message=(
            f"{info.numel} of {info.numel} elements of {info.name} are held by no rank "
            "(held pieces are on no rank); their gradient is absent from every norm"
        ),
        params=(info.name,),
        evidence={"num_gap_elements": info.numel, "numel": info.numel},
    )


def _unheld_params(unheld: list[ParamInfo], num_params: int) -> Hit:
    names = sorted(info.name for info in unheld)
    listed = names[:MAX_FOLDED_PARAMS_LISTED]
    more = ", …" if len(names) > len(listed) else ""
    numel = sum(info.numel for info in unheld)
    return Hit(
        message=(
            f"{len(unheld)} of the step's {num_params} parameters are held by no rank at all "
            f"({', '.join(listed)}{more}; {numel} elements); their gradients are absent from every norm"
        ),
        params=tuple(listed),
        evidence={"num_params": len(unheld), "num_gap_elements": numel, "numel": numel},
    )


def parameters_not_captured(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    step = inputs.step
    left_out: dict[str, tuple[str, list[int]]] = {}
    for rank in step.ranks_present:
        for param in step.ranks[rank].not_captured:
            left_out.setdefault(param.name, (param.reason, []))[1].append(rank)
    if not left_out:
        return ()
    named = "; ".join(
        f"{name} on {ranks_named(ranks)}: {clipped(reason)}"
        for name, (reason, ranks) in sorted(left_out.items())[:10]
    )
    more = f" (and {len(left_out) - 10} more)" if len(left_out) > 10 else ""
    return Skip(
        reason=f"{len(left_out)} parameter(s) were not captured, so every norm here leaves them out: {named}{more}"
    )
