"""Reading the dumped tensors once, by parameter, into the numbers the checks need (the shell side).

The unit of work is one logical parameter: all its pieces on all present ranks, read by chunks
(never more than a few pieces' chunks in memory) into the step's PieceTable, with its frozen
`ParamMeasurement`; `measure_step` spreads parameters over worker threads, optionally a subset, and
freezes the table into the step table. Measurements of disjoint subsets join into the result of one
pass (`scaleout.merged`: parameters split among processes). The inner loop over chunks is
kernel.ChunkKernel; all of it is numpy, so that checking a dump never imports torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from ..dumpfile.dump import StepDump
from ..model import ParamInfo, Piece, TensorKind
from ..norms import divide_by_power
from ..steptable import (
    ParamMeasurement,
    ReferenceDifference,
    ReplicaCopy,
    ReplicaSet,
    StepMeasurements,
)
from .measurements import SCALED_KINDS, piece_flat

if TYPE_CHECKING:
    from ..dumpfile.reader import TensorReader
    from ..steptable import StepTable
    from .kernel import ChunkKernel
    from .table import PieceTable

COMPARED_KINDS: tuple[TensorKind, ...] = ("grad", "grad_clipped", "param_after")
"""Tensor kinds compared against an unsharded reference."""

Progress = Callable[[int, int], None]

PARALLEL_MIN_BYTES = 32 << 20
"""Below this much tensor data a step is read by the calling thread alone: starting a pool costs
more than the second core gives back (the 4-rank toy dump: 2.3 ms alone, 7 ms with two threads)."""

CHUNK_ELEMENTS = 1 << 16
"""Elements read and reduced at a time per tensor: kernel.KERNEL_CHUNK_ELEMENTS (the float64 buffer
stays in cache). numpy and the kernel load on first measurement."""


def overflow_notes(table: StepTable, limit: int = 5) -> tuple[str, ...]:
    """Why a norm is inf although every value is finite: pieces whose float64 sum of squares (or
    their term of the p-norm, sum |x|^p) exceeds float64. Such a sum is stored as inf, so every norm
    that includes it is inf."""
    import numpy as np

    notes = []
    grad = table.grad
    overflowing = np.flatnonzero(grad.has & (np.isinf(grad.sum_sq) | np.isinf(grad.term)))
    overflowing = overflowing[(grad.counts[overflowing].sum(axis=1) == 0) & (table.numel[overflowing] > 0)]
    for at in overflowing.tolist():
        sums = (("squares", grad.sum_sq[at]), (f"|x|^{table.norm_type:g}", grad.term[at]))
        what = next(what for what, value in sums if math.isinf(value))
        notes.append(
            f"{table.param_names[table.param[at]]} on rank {table.rank[at]}: the sum of {what} of its finite "
            f"gradient values (max |x| {grad.max_abs[at]:.6g}) exceeds float64, so norms that include it "
            "are reported as inf"
        )
    if len(notes) > limit:
        notes = notes[:limit] + [f"and {len(notes) - limit} more pieces whose sums exceed float64"]
    return tuple(notes)


# ---------------------------------------------------------------- one parameter


def _read_values(
    table: PieceTable,
    positions: range,
    reader: TensorReader,
    kernel: ChunkKernel,
    fingerprinted: Collection[int] = (),
) -> None:
    """Read the values of the pieces at these positions that hold some, into the table: their
    statistics (values measured here win over stored summaries) and two-tensor products, with
    the fingerprint of those in `fingerprinted`."""
    import numpy as np

    if not table.with_values:
        return
    at = np.arange(positions.start, positions.stop)
    chosen = at[np.any([flags[at] for flags in table.with_values.values()], axis=0)]
    for position, scale, (path, tensors, numel) in zip(
        chosen.tolist(), table.scale_at[chosen].tolist(), table.tensors(chosen), strict=True
    ):
        read, dot_pre_post, dot_pre_pre, update_sum_sq = kernel.read_piece(
            reader, path, tensors, numel, table.read_norm_type, fingerprint=position in fingerprinted
        )
        if dot_pre_post is not None and dot_pre_pre is not None and scale != 1.0:
            dot_pre_post = divide_by_power(dot_pre_post, scale, 2.0)
            dot_pre_pre = divide_by_power(dot_pre_pre, scale, 2.0)
        table.record(position, read, (dot_pre_post, dot_pre_pre, update_sum_sq))


def _compare_replicas(
    reader: TensorReader, copies: list[tuple[int, str, Piece, float]], found: ReplicaSet, chunk: int
) -> ReplicaSet:
    """The set `found` (compared by fingerprint), its copies (rank, path, piece, value scale) compared
    with its base copy by gradient values when all have them, and by `param_before` when all have it."""
    copies = sorted(copies, key=lambda c: (c[0], c[2].index))
    if all("grad" in p.tensors for _, _, p, _ in copies):
        diffs = _differences(reader, copies, "grad", chunk)[0]
        results = [
            ReplicaCopy(rank=rank, index=piece.index, max_abs_diff=diff, num_nonfinite_mismatch=mismatch)
            for (rank, _, piece, _), (diff, mismatch) in zip(copies[1:], diffs, strict=True)
        ]
        found = replace(found, copies=tuple(results), by_values=True)
    if all("param_before" in p.tensors for _, _, p, _ in copies):
        diffs, base_max = _differences(reader, copies, "param_before", chunk)  # kept unscaled
        results = [replace(c, param_max_abs_diff=d) for c, (d, _) in zip(found.copies, diffs, strict=True)]
        found = replace(found, copies=tuple(results), param_base_max_abs=base_max)
    return found


def _differences(
    reader: TensorReader, copies: list[tuple[int, str, Piece, float]], kind: TensorKind, chunk: int
) -> tuple[list[tuple[float, int]], float]:
    """(the largest difference and the nonfinite mismatches of each copy but the first from the first,
    in their tensor `kind` divided by their scale; the first's largest finite |x|)."""
    from .kernel import windows
    from .reference import compare_values

    _, base_path, base, base_scale = copies[0]
    others = copies[1:]
    diffs = [0.0] * len(others)
    mismatches = [0] * len(others)
    base_max = 0.0
    per_copy = max(1 << 16, chunk // max(1, len(copies)))
    for start, stop in windows(base.numel, per_copy):
        ref = piece_flat(reader, base_path, base, kind, start, stop, base_scale)
        for i, (_, path, piece, scale) in enumerate(others):
            diff, largest, mismatch = compare_values(
                piece_flat(reader, path, piece, kind, start, stop, scale), ref
            )
            diffs[i] = max(diffs[i], diff)
            mismatches[i] += mismatch
            base_max = max(base_max, largest)  # the largest finite |x| of the base's values
    return list(zip(diffs, mismatches, strict=True)), base_max


def _replica_sets(
    table: PieceTable, positions: range, reader: TensorReader, chunk: int
) -> tuple[ReplicaSet, ...]:
    """The parameter's layouts held on two or more ranks, compared copy by copy: by fingerprint on
    the table's columns, then one set at a time by values where its copies hold them."""
    import numpy as np

    replicated = np.flatnonzero(table.copies[table.layout[positions.start : positions.stop]] > 1)
    replicated += positions.start
    sets = table.replica_sets(replicated) if replicated.size else ()
    if not table.with_values:
        return sets
    by_layout: dict[int, list[tuple[int, str, Piece, float]]] = {}
    layouts, scales = table.layout[replicated].tolist(), table.scale_at[replicated].tolist()
    for layout, scale, entry in zip(layouts, scales, table.entries(replicated), strict=True):
        by_layout.setdefault(layout, []).append((*entry, scale))
    groups = sorted(by_layout.values(), key=lambda copies: min((r, p.index) for r, _, p, _ in copies))
    return tuple(
        _compare_replicas(reader, copies, found, chunk) for copies, found in zip(groups, sets, strict=True)
    )


def _fingerprinted(table: PieceTable, positions: range) -> set[int]:
    """The positions with gradient values whose replica set also holds stats-only copies: those
    are compared by fingerprint, so theirs must be computed (it costs several passes)."""
    import numpy as np

    values = table.with_values.get("grad")
    layout = table.layout[positions.start : positions.stop]
    if values is None or not (table.copies[layout] > 1).any():
        return set()
    with_values = values[positions.start : positions.stop]
    _, inverse, copies = np.unique(layout, return_inverse=True, return_counts=True)
    holding = np.bincount(inverse, weights=with_values, minlength=copies.size)
    mixed = (holding > 0) & (holding < copies)
    return set((np.flatnonzero(mixed[inverse] & with_values) + positions.start).tolist())


def _measure_reference(
    name: str,
    reader: TensorReader,
    infos: tuple[ParamInfo | None, ParamInfo | None],
    tables: tuple[PieceTable, PieceTable],
    *,
    chunk: int,
    kernel: ChunkKernel,
) -> tuple[bool, tuple[ReferenceDifference, ...], tuple[str, ...]]:
    """(whether the reference's pieces of the parameter were read, the differences, notes)."""
    from ..norms import norm_rtol
    from .reference import ReferenceSource, compare_regions, covers

    info, ref_info = infos
    table, ref_table = tables
    if ref_info is None:
        return False, (), (f"{name}: not in the reference dump",)
    if info is not None and tuple(ref_info.global_shape) != tuple(info.global_shape):
        shapes = f"{list(info.global_shape)} here but {list(ref_info.global_shape)} in the reference"
        return False, (), (f"{name}: shape {shapes}",)
    positions = ref_table.param_positions(name)
    _read_values(ref_table, positions, reader, kernel)
    ref_held, cover = ref_table.entries(positions), table.cover(name)
    errors, notes = [], []
    for kind in COMPARED_KINDS:
        ref_with_values = [(path, piece) for _, path, piece in ref_held if kind in piece.tensors]
        ours = [(rank, path, piece) for rank, path, piece in cover if kind in piece.tensors]
        if not ours or not ref_with_values:
            continue
        if not covers(ref_with_values, ref_info.global_shape):
            notes.append(f"{name}: the reference's {kind} pieces do not cover the parameter; not compared")
            continue
        ref_rank = next(rank for rank, _, piece in ref_held if kind in piece.tensors)
        ref_scale = ref_table.scale_of(ref_rank) if kind in SCALED_KINDS else 1.0
        source = ReferenceSource(reader, tuple(ref_info.global_shape), ref_with_values, kind, ref_scale)
        per_piece = []
        for rank, path, piece in ours:
            read_ours = functools.partial(piece_flat, reader, path, piece, kind, scale=table.scale_of(rank))
            per_piece.append(compare_regions(read_ours, piece.regions, source, chunk))
        errors.append(
            ReferenceDifference(
                param=name,
                kind=kind,
                dtype=max((piece.dtype for _, _, piece in ours), key=lambda dtype: norm_rtol([dtype])),
                numel_compared=sum(compared for _, _, _, compared in per_piece),
                max_abs_error=max(error for error, _, _, _ in per_piece),
                max_abs_reference=max(largest for _, largest, _, _ in per_piece),
                num_nonfinite_mismatch=sum(mismatches for _, _, mismatches, _ in per_piece),
            )
        )
    return True, tuple(errors), tuple(notes)


def measure_step(
    step: StepDump,
    reader: TensorReader,
    *,
    norm_type: float | None = None,
    reference: StepDump | None = None,
    params: Iterable[str] | None = None,
    progress: Progress | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    workers: int | None = None,
) -> StepMeasurements:
    """Measure the given parameters (all of the step's by default) of one step, parameter by parameter.

    Parameters with tensor data are spread over `workers` threads (default: the usable cores, or
    one below PARALLEL_MIN_BYTES of tensor data), the largest first; each thread reads with its own
    TensorReader and buffers, so memory is a few chunks per thread whatever the size of the dump.
    numpy's reductions release the GIL, and each parameter is reduced by one thread in a fixed chunk
    order, so the result is the same bits for any number of workers. `progress(done, total)` is
    called after each parameter, from the calling thread.
    """
    if norm_type is None:
        norm_type = step.clip.norm_type if step.clip is not None else 2.0
    known = step.params
    names = sorted(known) if params is None else sorted(set(params))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"parameters {unknown[:3]} are not in step {step.step}; pass names from step.params")
    from .partials import partial_sums, record_sum
    from .table import piece_table, step_table

    sums, dropped = partial_sums(step)
    table = piece_table(step, names, norm_type=norm_type, dropped=dropped)
    ref_table = None if reference is None else piece_table(reference, names, norm_type=norm_type)
    reference_infos = {} if reference is None else reference.params
    compared: set[str] = set()
    """The parameters whose reference pieces were read."""

    def measure(name: str, worker_reader: TensorReader, kernel: ChunkKernel) -> ParamMeasurement:
        positions = table.param_positions(name)
        _read_values(table, positions, worker_reader, kernel, _fingerprinted(table, positions))
        for members in sums.get(name, []):
            record_sum(table, members, worker_reader)
        found = ParamMeasurement(
            param=name,
            norm_type=norm_type,
            replica_sets=_replica_sets(table, positions, worker_reader, chunk_elements),
        )
        if ref_table is None:
            return found
        read, errors, notes = _measure_reference(
            name,
            worker_reader,
            (known[name], reference_infos.get(name)),
            (table, ref_table),
            chunk=chunk_elements,
            kernel=kernel,
        )
        if read:
            compared.add(name)
        return replace(found, reference_errors=errors, notes=notes)

    cost = bytes_to_read(step, reference)
    if workers is None:
        workers = 1 if sum(cost.values()) < PARALLEL_MIN_BYTES else available_workers()
    results = _measure_all(
        names,
        cost,
        measure,
        reader,
        workers=workers,
        chunk_elements=chunk_elements,
        progress=progress,
    )
    return StepMeasurements(
        norm_type=norm_type,
        params=dict(sorted(results.items())),
        table=step_table(step, table, names),
        reference_table=None
        if ref_table is None or reference is None
        else step_table(reference, ref_table, sorted(compared)),
        reference_given=reference is not None,
        reference_step=None if reference is None else reference.step,
        reference_only_params=tuple(sorted(set(reference_infos) - set(known))),
    )


def bytes_to_read(step: StepDump, reference: StepDump | None = None) -> dict[str, int]:
    """Bytes of tensor data measuring each parameter reads: its pieces' tensors here and in the reference."""
    from ..dumpfile.header import SAFETENSORS_DTYPES

    itemsize = dict(SAFETENSORS_DTYPES.values())
    cost = dict.fromkeys(step.params, 0)
    for dump in (step,) if reference is None else (step, reference):
        for rank in dump.ranks_present:
            pieces = dump.ranks[rank].pieces
            dtypes = pieces.extras.dtypes
            for keys in pieces.extras.tensors.values():  # none for statistics only: nothing to read
                for at in keys:
                    info = pieces.params[int(pieces.rows[at, 0])]
                    if info.name in cost:
                        cost[info.name] += int(pieces.numel[at]) * itemsize.get(dtypes.get(at, info.dtype), 8)
    return cost


def _measure_all(
    names: list[str],
    cost: Mapping[str, int],
    measure: Callable[[str, TensorReader, ChunkKernel], ParamMeasurement],
    reader: TensorReader,
    *,
    workers: int,
    chunk_elements: int,
    progress: Progress | None,
) -> dict[str, ParamMeasurement]:
    """Parameters without tensor data (stats only) are measured here at once: reading nothing, they
    would only contend for the GIL. The others go to the worker threads, largest first."""

    results: dict[str, ParamMeasurement] = {}

    def finished(name: str, measurement: ParamMeasurement) -> None:
        results[name] = measurement  # one entry per parameter done: the names are distinct
        if progress is not None:
            progress(len(results), len(names))

    from .kernel import ChunkKernel

    kernel = ChunkKernel(chunk_elements)
    to_read = sorted((n for n in names if cost[n] > 0), key=lambda n: (-cost[n], n))
    serial = workers <= 1 or len(to_read) <= 1
    for name in names:
        if serial or cost[name] == 0:
            finished(name, measure(name, reader, kernel))
    if serial:
        return results
    import threading
    from concurrent.futures import ThreadPoolExecutor, as_completed

    local = threading.local()
    opened: list[TensorReader] = []  # appended to by the workers: list.append is atomic

    def in_worker(name: str) -> ParamMeasurement:
        if not hasattr(local, "reader"):
            local.reader, local.kernel = reader.another(), ChunkKernel(chunk_elements)
            opened.append(local.reader)
        return measure(name, local.reader, local.kernel)

    try:
        with ThreadPoolExecutor(
            max_workers=min(workers, len(to_read)), thread_name_prefix="gradaudit-measure"
        ) as pool:
            futures = {pool.submit(in_worker, name): name for name in to_read}
            try:
                for future in as_completed(futures):
                    finished(futures[future], future.result())
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    finally:
        for worker_reader in opened:
            worker_reader.close()
    return results


def available_workers() -> int:
    """The cores this process may use."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
