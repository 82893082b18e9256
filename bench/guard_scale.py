"""The guard's verdict at 1,024, 4,096 and 16,384 ranks without a cluster: every rank's row generated
(an HSDP-like layout: one group replicated over pairs of ranks, one sharded), summed as the guard's
all-reduce sums them, and judged by the functions the guard calls: `Reduction.verdict` on the common
path; on a failing step (one rank's reported norm local), `agree` and the full diagnosis of the
gathered rows (`LiveStep` -> `report_of`).

    python bench/guard_scale.py            # 1024, 4096, 16384 ranks
    python bench/guard_scale.py --ranks 1024
    python bench/guard_scale.py --failing 3   # the failing step's best of 3 (a shared machine)

Prints, per world size: the bytes each rank sends per collective (the sum on every step, its row on a
failing step), the common path's median time, and the failing step's time (the best of `--failing`
runs, wall and this process's CPU time: on a shared machine the CPU time is the steadier) and peak
memory (the first run's RSS growth, read from /proc), against the targets (1 ms; 1 s and 1 GiB).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gradaudit.capture.arguments import CallRecord
from gradaudit.live.agreement import agree
from gradaudit.live.analysis_input import LiveStep, OwnershipGroup, report_of
from gradaudit.live.fastpath import Reduction, role_of
from gradaudit.live.summary import VectorLayout, pack, stamped
from gradaudit.model import Topology

MAX_NORM = 1.0
GROUPS = (OwnershipGroup(name="rep", replica_group="rep"), OwnershipGroup(name="sharded", replica_group=None))


def _rss() -> int:
    """This process's resident memory now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _rows(world: int, *, local_on: int | None) -> tuple[VectorLayout, np.ndarray, Topology]:
    """Every rank's packed row of one step; rank `local_on` reports its local norm (a failing step)."""
    rng = np.random.default_rng(world)
    layout = VectorLayout(num_groups=len(GROUPS))
    shards = rng.uniform(0.5, 1.5, world) / world
    replicated = rng.uniform(0.5, 1.5, world // 2) / world
    true = math.sqrt(math.fsum(shards) + math.fsum(replicated))
    topology = Topology(groups={"rep": tuple((r, r + world // 2) for r in range(world // 2))})
    rows = np.empty((world, layout.size))
    for rank in range(world):
        local = torch.tensor(
            [replicated[rank % (world // 2)], shards[rank], 0.0, 0.0, 0.0, 0.0], dtype=torch.float64
        )
        reported = math.sqrt(float(local[:2].sum())) if rank == local_on else true
        coef = min(1.0, MAX_NORM / (reported + 1e-6))
        call = CallRecord(
            terms=local[:2], reported=reported, max_norm=MAX_NORM, norm_type=2.0, coef=None, before=None
        )
        vector = pack(
            layout,
            device="cpu",
            terms=local,
            applied_coef=coef,
            calls=[call],
            num_calls=1,
            grad_dtype="float32",
        )
        rows[rank] = stamped(vector, step=7, clock=7, changed=False).numpy()
    return layout, rows, topology


def _summed(layout: VectorLayout, rows: np.ndarray, topology: Topology) -> tuple[Reduction, np.ndarray]:
    world = rows.shape[0]
    reduction = Reduction(layout=layout)
    held = [(True, True)] * world
    topologies = [topology] * world
    total = np.zeros(reduction.size)
    for rank in range(world):
        total += reduction.contribution(rows[rank], role_of(rank, GROUPS, held, topologies), MAX_NORM)
    return reduction, total


def _full_diagnosis(
    layout: VectorLayout, rows: np.ndarray, topology: Topology
) -> tuple[str, tuple[str, ...]]:
    world = rows.shape[0]
    conclusion = agree(rows).conclusion
    ranks = layout.unpack_rows(rows, held=[(True, True)] * world, topologies=[topology] * world)
    live = LiveStep(step=7, world_size=world, max_norm=MAX_NORM, norm_type=2.0, groups=GROUPS, ranks=ranks)
    report = report_of(live)
    return conclusion, tuple(sorted({f.code for f in report.findings if f.severity.name == "ERROR"}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--failing", type=int, default=1, help="runs of the failing step's diagnosis")
    args = parser.parse_args(argv)
    for world in (int(w) for w in args.ranks.split(",")):
        layout, rows, topology = _rows(world, local_on=None)
        reduction, summed = _summed(layout, rows, topology)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            verdict = reduction.verdict(summed, norm_type=2.0, max_norm=MAX_NORM)
            times.append(time.perf_counter() - start)
        assert verdict is not None and verdict.kind == "passed", "a correct synthetic step was not settled"
        common = statistics.median(times)
        layout, rows, topology = _rows(world, local_on=world - 1)
        reduction, summed = _summed(layout, rows, topology)
        assert reduction.verdict(summed, norm_type=2.0, max_norm=MAX_NORM) is None
        _full_diagnosis(*_rows(64, local_on=63))  # imports and first-call costs, not the world's
        before, grown = _rss(), 0
        failing = cpu = math.inf
        for _ in range(max(1, args.failing)):
            start, start_cpu = time.perf_counter(), time.process_time()
            conclusion, codes = _full_diagnosis(layout, rows, topology)
            failing = min(failing, time.perf_counter() - start)
            cpu = min(cpu, time.process_time() - start_cpu)
            grown = grown or _rss() - before
        assert conclusion == "judge" and codes, (conclusion, codes)
        print(
            f"== {world} ranks: bytes per rank per collective: sum {reduction.size * 8} (every step), "
            f"row {layout.size * 8} (a failing step's all-gather: {world * layout.size * 8} received)"
        )
        print(
            f"RATIO {world} ranks common path / 1 ms target = {common / 1e-3:.4f} ({common * 1e6:.0f} us median)"
        )
        print(
            f"RATIO {world} ranks failing step / 1 s target = {failing:.4f} ({failing:.2f} s, "
            f"CPU {cpu:.2f} s, codes {', '.join(codes)})"
        )
        print(
            f"RATIO {world} ranks failing step memory / 1 GiB target = {grown / 2**30:.4f} ({grown / 2**20:.0f} MiB RSS growth)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
