"""What the benchmark measures, each run alone in a fresh process: `python bench/subjects.py NAME JSON_ARGS`.

Each subject imports what it needs first, then times only its work, and prints one JSON line
{"seconds": ..., "value": ...} on stdout. The parent reads the process's peak resident memory.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

FLOOR_CHUNK_ELEMENTS = 1 << 18
"""256K elements: the float64 buffer (2 MiB) stays in cache."""


def _rank_files(directory: str) -> list[Path]:
    return sorted(Path(directory).glob("rank_*.safetensors"))


def floor(directory: str, chunk_elements: int = FLOOR_CHUNK_ELEMENTS) -> float:
    """The floor: one single-threaded pass that reads every gradient and sums its squares in float64.

    As lean as a straightforward pass gets: each chunk of bytes is read with readinto into one reused
    buffer, viewed as its dtype, widened into one reused float64 buffer and dotted with itself; no
    memory map (whose touched pages would count as resident) and no allocation per chunk.
    """
    import torch

    from gradaudit.dumpfile.header import read_header

    torch.set_num_threads(1)
    raw = bytearray(chunk_elements * 8)
    wide = torch.empty(chunk_elements, dtype=torch.float64)
    total = 0.0
    for path in _rank_files(directory):
        entries = read_header(str(path)).tensors
        with open(path, "rb", buffering=0) as handle:
            for key in sorted(k for k in entries if "::grad::" in k):
                entry = entries[key]
                dtype = getattr(torch, entry.dtype)
                itemsize = torch.empty((), dtype=dtype).element_size()
                handle.seek(entry.begin)
                remaining = entry.end - entry.begin
                while remaining:
                    size = min(remaining, chunk_elements * itemsize)
                    view = memoryview(raw)[:size]
                    got = handle.readinto(view)
                    if got != size:
                        raise SystemExit(f"{path}: short read of {key}")
                    values = torch.frombuffer(raw, dtype=dtype, count=size // itemsize)
                    part = wide[: values.numel()]
                    part.copy_(values)
                    total += float(torch.dot(part, part))
                    remaining -= size
    return math.sqrt(total)


def naive(directory: str) -> float:
    """The naive way: load every file fully, concatenate every gradient, take the norm."""
    import torch
    from safetensors.torch import load_file

    grads = []
    for path in _rank_files(directory):
        tensors = load_file(str(path))
        grads.extend(tensors[k].reshape(-1) for k in sorted(tensors) if "::grad::" in k)
    everything = torch.cat(grads)
    del grads
    return float(torch.linalg.vector_norm(everything.float()))


def check(directory: str) -> float:
    """gradaudit's own check, in process: gradaudit.audit.audit_step_dir."""
    from gradaudit.audit import audit_step_dir
    from gradaudit.checks.base import AuditOptions

    report = audit_step_dir(directory, AuditOptions())
    if report.global_norm is None:
        raise SystemExit(f"check gave no global norm for {directory}")
    return report.global_norm


def check_codes(directory: str) -> list[str]:
    from gradaudit.audit import audit_step_dir
    from gradaudit.checks.base import AuditOptions

    return sorted({f.code for f in audit_step_dir(directory, AuditOptions()).findings})


def load_headers(directory: str) -> int:
    """Only the loader: read and validate every rank file's header (no tensor data)."""
    from gradaudit.dumpfile import load_step

    return len(load_step(directory).ranks)


CAPTURE_SUBJECTS = ("audit_step", "save_file", "params_ladder")


def coverage(layout: str, num_pieces: int, num_ranks: int = 64) -> float:
    """The ownership checks (GA102 overlap, GA103 gap) of one parameter cut into `num_pieces` pieces
    spread over `num_ranks` ranks, on a StepDump built in memory. Returns the seconds of the checks
    alone (building the StepDump is not timed)."""
    from dataclasses import replace

    from gradaudit.analysis.coverage import coverage_by_param
    from gradaudit.audit import analyse
    from gradaudit.checks.base import AuditOptions
    from gradaudit.checks.coverage import ownership_gap, ownership_overlap
    from gradaudit.measure.table import piece_table, step_table
    from gradaudit.steptable import StepMeasurements

    step = _coverage_step(layout, num_pieces, num_ranks)
    table = step_table(step, piece_table(step, ()), ())  # nothing measured: the checks read the coverage
    measured, options = StepMeasurements(norm_type=2.0, params={}, table=table), AuditOptions()
    analysed = analyse(step, measured, coverage={}, update_judgements={})
    start = time.perf_counter()
    inputs = replace(analysed, coverage=coverage_by_param(step))
    hits = ownership_overlap(inputs, options), ownership_gap(inputs, options)
    seconds = time.perf_counter() - start
    if any(hits):
        raise SystemExit(f"coverage layout {layout!r} is a clean cover, but the checks found {hits}")
    return seconds


def _coverage_regions(layout: str, num_pieces: int):
    """(global shape, regions) of a clean cover: flat ranges that straddle rows, a grid of 2-D boxes,
    or row blocks each held by 4 replicas."""
    from layouts import even_flat_ranges

    from gradaudit.model import Box, FlatRange

    if layout == "flat":  # square: as many distinct column offsets as row boundaries
        shape = (num_pieces, num_pieces)
        return shape, [
            FlatRange(start=a, stop=b) for a, b in even_flat_ranges(num_pieces**2, num_pieces + 7) if b > a
        ]
    if layout == "grid":
        side = math.isqrt(num_pieces)
        shape = (side * 64, side * 64)
        return shape, [
            Box(offsets=(64 * i, 64 * j), shape=(64, 64)) for i in range(side) for j in range(side)
        ]
    blocks = num_pieces // 4
    shape = (blocks * 8, 256)
    return shape, [Box(offsets=(8 * i, 0), shape=(8, 256)) for i in range(blocks) for _ in range(4)]


def _coverage_step(layout: str, num_pieces: int, num_ranks: int):
    from gradaudit.dumpfile.dump import RankDump, as_columns
    from gradaudit.dumpfile.loader import assemble_step
    from gradaudit.model import ParamInfo, Piece

    shape, regions = _coverage_regions(layout, num_pieces)
    info = ParamInfo(name="w", global_shape=shape, dtype="float32")
    per_rank: list[list] = [[] for _ in range(num_ranks)]
    for i, region in enumerate(regions):
        rank = i % num_ranks
        per_rank[rank].append(
            Piece(
                index=len(per_rank[rank]),
                param="w",
                regions=(region,),
                local_shape=(region.numel,),
                dtype="float32",
            )
        )
    ranks = {
        rank: RankDump(
            path=f"rank{rank}",
            rank=rank,
            world_size=num_ranks,
            step=1,
            params=(info,),
            pieces=as_columns((info,), pieces),
        )
        for rank, pieces in enumerate(per_rank)
    }
    return assemble_step("memory", ranks)


SUBJECTS = {
    "floor": floor,
    "naive": naive,
    "check": check,
    "check_codes": check_codes,
    "load_headers": load_headers,
    "coverage": coverage,
}


def measure(name: str, args: dict) -> tuple[float, object]:
    """Run subject `name` with `args`: (seconds of its work alone, what it returned)."""
    if name in CAPTURE_SUBJECTS:
        from capture_subjects import run_capture_subject

        return run_capture_subject(name, args)
    # Imported before the clock starts, for every subject alike.
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    import gradaudit.dumpfile

    if name.startswith("check"):
        import gradaudit.audit  # noqa: F401
    start = time.perf_counter()
    value = SUBJECTS[name](**args)
    seconds = time.perf_counter() - start
    if name == "coverage":
        seconds = value  # timed inside: building the step in memory is not part of the check
    return seconds, value


def main(argv: list[str]) -> None:
    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    seconds, value = measure(name, args)
    sys.stdout.write(json.dumps({"seconds": seconds, "value": value}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
