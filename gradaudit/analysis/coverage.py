"""Who holds which element of each parameter: the ownership coverage of a step (GA102 and GA103
read it), from the pieces' columns; it needs the step only, not the measurements."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, TypeAlias, cast

from ..dumpfile.dump import StepDump
from ..errors import StepFolderError, shown
from ..measure.leftout import left_out_params
from ..model import FlatRange, ParamInfo, Region, numel_of
from .geometry import BoxTuple, Coverage, CoverageTooIntricate, coverage, region_boxes

if TYPE_CHECKING:
    import numpy as np

    from ..dumpfile.columnar import ParamIds


Layouts = dict[tuple[Region, ...], list[int]]
"""A parameter's distinct layouts (the regions of one piece) -> the ranks holding them."""


class ParamCoverage(NamedTuple):
    """Who holds which element of one parameter."""

    info: ParamInfo
    coverage: Coverage
    """Its overlaps and gaps."""
    overlap_ranks: list[int]
    """The ranks holding an element some other rank holds too (not as a replica)."""
    holders: list[int]
    """The ranks holding some of it."""


def layouts_by_param(step: StepDump) -> dict[str, Layouts]:
    """Parameter -> its distinct layouts (replicas merged) -> the ranks holding them, in one pass."""
    found: dict[str, Layouts] = {name: {} for name in step.params}
    for rank in step.ranks_present:
        pieces = step.ranks[rank].pieces
        names = [info.name for info in pieces.params]
        for param, regions in zip(pieces.rows[:, 0].tolist(), pieces.regions(), strict=True):
            found.setdefault(names[param], {}).setdefault(regions, []).append(rank)
    return found


def _param_coverage(shape: tuple[int, ...], holders: Layouts) -> tuple[Coverage, list[int]]:
    layouts = list(holders)
    if all(isinstance(r, FlatRange) for regions in layouts for r in regions):
        # Flat ranges are intervals of the flattened parameter: a 1-D sweep, O(k log k). Cut into boxes
        # of a 2-D parameter they would cost the rectangle sweep rows x columns (quadratic in k).
        shape = (numel_of(shape),)
    boxes: list[BoxTuple] = [
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
    flat, covered, holding = _flat_pieces_by_param(step)
    layouts: dict[str, Layouts] | None = None
    found: dict[str, ParamCoverage] = {}
    holders: dict[bytes, list[int]] = {}
    unheld: list[int] = []
    left_out = left_out_params(step)  # not checked (GA104): part of them is in no rank's file
    for name, info in step.params.items():
        if name in left_out:
            continue
        if name in covered:  # disjoint flat ranges, found for all parameters at once
            found[name] = ParamCoverage(
                info, _disjoint(numel_of(info.global_shape) - covered[name]), [], holding
            )
            continue
        if name not in flat:  # held by no rank: all of it is a gap (most of a table listing 10^6)
            found[name] = ParamCoverage(info, _disjoint(info.numel), unheld, unheld)
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
        held_by = sorted({r for rs in layouts[name].values() for r in rs})
        found[name] = ParamCoverage(info, result, ranks, held_by)
    return found


FlatPieces: TypeAlias = "tuple[np.ndarray, np.ndarray, np.ndarray] | None"
"""A parameter's pieces as (starts, stops, ranks) when each is one flat range, else None."""


def _flat_pieces_by_param(step: StepDump) -> tuple[dict[str, FlatPieces], dict[str, int], list[int]]:
    """Every parameter's pieces as three integer arrays (no object per piece of a format-1.1 rank);
    when every rank holds one flat range of the same parameters, in the same order (FSDP/ZeRO), the
    elements covered by the disjoint ones instead, for all parameters at once, and the ranks."""

    from ..dumpfile.columnar import ParamIds

    ids = ParamIds(list(step.params))
    uniform = _uniform_columns(step, ids)
    if uniform is not None:
        return _uniform_flat_ranges(*uniform, list(ids.ids))
    columns: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]] = []
    for rank in step.ranks_present:
        pieces = step.ranks[rank].pieces
        rows, coords = pieces.rows, pieces.coords
        first = rows[:, 2]  # a box has at least two coordinates too: both reads stay inside
        flat = rows[:, 3] == 0
        flat[list(pieces.extras.regions)] = False  # not one region
        laid_out = coords.size == 2 * first.size and flat.all()  # piece after piece: start, stop, ...
        start, stop = (coords[0::2], coords[1::2]) if laid_out else (coords[first], coords[first + 1])
        columns.append((ids.of(pieces), start, stop, flat, rank))
    if not columns:
        return {}, {}, []
    return _pieces_by_param(columns, list(ids.ids)), {}, []


_Uniform: TypeAlias = "tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]"
"""(ranks, start, stop, parameter ids): ranks x pieces, each piece one flat range, every rank holding
pieces of the same parameters in the same order."""


def _uniform_columns(step: StepDump, ids: ParamIds) -> _Uniform | None:
    """Every rank's flat ranges at once, when every rank holds one flat range of the same parameters,
    in the same order, laid out piece after piece (FSDP/ZeRO, the guard's ownership groups); None
    otherwise, and when in doubt (the per-rank reading then decides). A few numpy passes over all
    ranks' columns, one column at a time (4096 ranks x 800 pieces: 26 MiB a column)."""
    import numpy as np

    dumps = [step.ranks[rank].pieces for rank in step.ranks_present]
    if not dumps:
        return None
    n = dumps[0].rows.shape[0]
    if any(d.rows.shape[0] != n or d.coords.size != 2 * n or d.extras.regions for d in dumps):
        return None
    if np.concatenate([d.rows[:, 3] for d in dumps]).any():  # a box
        return None
    table = ids.table(dumps[0].params)
    same = all(ids.table(d.params) is table for d in dumps)  # one table (the usual): its indices compare
    param = np.concatenate([d.rows[:, 0] if same else ids.of(d) for d in dumps]).reshape(len(dumps), n)
    held = table[param[0]] if same else param[0]
    if np.unique(held).size != n or not (param == param[0]).all():
        return None  # the per-rank reading decides
    del param
    coords = np.concatenate([d.coords for d in dumps]).reshape(len(dumps), 2 * n)
    ranks = np.array(step.ranks_present, dtype=np.int64)
    return ranks, coords[:, 0::2], coords[:, 1::2], held


def _uniform_flat_ranges(
    ranks: np.ndarray, start: np.ndarray, stop: np.ndarray, held: np.ndarray, names: list[str]
) -> tuple[dict[str, FlatPieces], dict[str, int], list[int]]:
    """Ranks x parameters held as one flat range each: the elements the distinct ranges cover where
    none overlaps another; the pieces of any other parameter, for the sweep."""
    import numpy as np

    order = None
    if (start[1:] >= stop[:-1]).all():  # each rank's range after the previous rank's (FSDP): disjoint
        covered = (stop - start).sum(axis=0)
        return {}, {names[p]: n for p, n in zip(held.tolist(), covered.tolist(), strict=True)}, ranks.tolist()
    if (start[1:] < start[:-1]).any():  # not already by start
        order = np.argsort(start, axis=0, kind="stable")
        start, stop = np.take_along_axis(start, order, 0), np.take_along_axis(stop, order, 0)
    same_start = start[1:] == start[:-1]
    same = same_start & (stop[1:] == stop[:-1])  # replicas: one layout
    counted = stop > start
    counted[1:] &= ~same
    reach = np.maximum.accumulate(np.where(counted, stop, np.iinfo(np.int64).min), axis=0)
    # Ranges by start that overlap no earlier one; equal starts with other stops go to the sweep.
    clean = ~((same_start & ~same).any(axis=0) | (counted[1:] & (start[1:] < reach[:-1])).any(axis=0))
    covered = np.where(counted, stop - start, 0).sum(axis=0)
    params = held.tolist()
    others: dict[str, FlatPieces] = {}
    done: dict[str, int] = {}
    for j, ok in enumerate(clean.tolist()):
        if ok:
            done[names[params[j]]] = int(covered[j])
        else:
            others[names[params[j]]] = (
                start[:, j],
                stop[:, j],
                ranks if order is None else ranks[order[:, j]],
            )
    return others, done, sorted(set(ranks.tolist()))


def _pieces_by_param(
    columns: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]], names: list[str]
) -> dict[str, FlatPieces]:
    import numpy as np

    param, start, stop, is_flat = (np.concatenate([c[k] for c in columns]) for k in range(4))
    ranks = np.concatenate([np.full(len(c[0]), c[4], dtype=np.int64) for c in columns])
    order = np.argsort(param, kind="stable")
    distinct, bounds = np.unique(param[order], return_index=True)
    bounds = np.append(bounds, order.size)
    found: dict[str, FlatPieces] = {}
    for k, param_id in enumerate(distinct.tolist()):
        chosen = order[bounds[k] : bounds[k + 1]]
        found[names[param_id]] = (
            (start[chosen], stop[chosen], ranks[chosen]) if is_flat[chosen].all() else None
        )
    return found


def _disjoint(num_gap_elements: int) -> Coverage:
    return Coverage(num_gap_elements=num_gap_elements, num_overlap_elements=0, overlapping_tags=frozenset())


def _flat_param_coverage(
    info: ParamInfo, pieces: FlatPieces, holders: dict[bytes, list[int]]
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
    kept = stops > starts  # the distinct nonempty ranges (replicas: one layout), by start
    kept[1:] &= (starts[1:] != starts[:-1]) | (stops[1:] != stops[:-1])
    starts, stops = starts[kept], stops[kept]
    if (starts[1:] < stops[:-1]).any():
        return None  # overlaps: the sweep names them
    result = _disjoint(numel_of(info.global_shape) - int((stops - starts).sum()))
    distinct = np.unique(ranks)
    key = distinct.astype(np.int64).tobytes()
    if key not in holders:  # one list for the parameters held by the same ranks (often all of them)
        holders[key] = distinct.tolist()
    return ParamCoverage(info, result, [], holders[key])
