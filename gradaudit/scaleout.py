"""Scale-out of the check on torch.distributed: under torchrun, each process loads a share of the
rank files and measures a share of the parameters; the loaded ranks and the partial measurements
are exchanged, so that every process holds the whole step and its measurements.

    torchrun --nproc-per-node 4 -m gradaudit check ./step_1200

Every process runs the checks across ranks (dumpfile.loader.load_step) and the audit on the whole
step, so every process reaches the same report and exit code; only rank 0 prints. A rank file that
cannot be read is passed on like a loaded one, so every process stops on the same file with the
message a single process gives. The group is gloo (CPU), created here from torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless the caller already initialised one. This
module and the capture hook are the only ones that touch torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from .errors import DumpFormatError, GradauditError, StepFolderError, UsageError

if TYPE_CHECKING:
    from pathlib import Path

    from .audit import Shares
    from .dumpfile.dump import StepDump
    from .dumpfile.loader import LoadFiles, LoadOutcome
    from .dumpfile.paramtable import SharedTables
    from .dumpfile.reader import TensorReader
    from .steptable import KindColumns, StepMeasurements, StepTable

GROUP_TIMEOUT = timedelta(minutes=10)
"""How long a process waits for the others at one exchange before giving up (a process that died
without reaching the exchange would otherwise hang the rest for gloo's default 30 minutes)."""


class ScaleOutError(GradauditError):
    """Another process of the scaled-out check failed; its message says which and why."""


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Where this process sits among the processes torchrun started."""

    rank: int
    """This process's rank among torchrun's processes."""
    world_size: int
    """Processes torchrun started."""
    local_world_size: int = 1
    """Processes on this node (they share its cores)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The torchrun environment of this process, or None when it was not started by torchrun with
    more than one process (then the check runs as a single process)."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ or "RANK" not in environ:
        return None
    try:
        env = LaunchEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1")),
        )
    except ValueError as exc:
        raise UsageError(
            f"RANK={environ['RANK']!r} WORLD_SIZE={environ['WORLD_SIZE']!r} is not a valid torchrun environment ({exc}); "
            "start the check with torchrun, or unset RANK and WORLD_SIZE"
        ) from None
    return env if env.world_size > 1 else None


def share_of(costs: Mapping[str, int], rank: int, world_size: int) -> list[str]:
    """The parameters process `rank` measures: a greedy split by cost (bytes to read), largest first,
    each to the least loaded process. The same on every process (it depends only on `costs`)."""
    loads = [0] * world_size
    mine = []
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += max(1, costs[name])
        if target == rank:
            mine.append(name)
    return sorted(mine)


@dataclass(frozen=True)
class Exchange:
    """All-gathers one picklable value per process; every exchange carries either a result or the
    error that stopped a process, so that one failing process stops all of them with its message
    instead of leaving them waiting."""

    env: LaunchEnv
    """Where this process stands in the launch (its rank and the number of processes)."""

    def gather(self, value: Any) -> list[Any]:
        outcomes = self._all_gather(("ok", value))
        for rank, (kind, payload) in enumerate(outcomes):
            if kind == "user":
                raise ScaleOutError(f"process {rank} of the scaled-out check stopped: {payload}")
            if kind == "internal":
                raise RuntimeError(f"process {rank} of the scaled-out check failed: {payload}")
        return [payload for _, payload in outcomes]

    def fail(self, exc: BaseException) -> None:
        """Tell the other processes, waiting at their next exchange, that this one failed."""
        kind = "user" if isinstance(exc, GradauditError) else "internal"
        with contextlib.suppress(Exception):
            self._all_gather((kind, f"{type(exc).__name__}: {exc}" if kind == "internal" else str(exc)))

    def _all_gather(self, outcome: tuple[str, Any]) -> list[tuple[str, Any]]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, outcome)
        return gathered


def _file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # loading it says why


def load_share(exchange: Exchange) -> LoadFiles:
    """A drop-in for `loader.load_rank_files` that loads this process's share of the files (split
    by bytes) and returns what every process loaded, in the order of `paths`."""
    from .dumpfile.loader import load_rank_files

    def load_files(paths: Sequence[Path], *, stop_at_error: bool, tables: SharedTables) -> list[LoadOutcome]:
        costs = {str(path): _file_bytes(path) for path in paths}
        mine = set(share_of(costs, exchange.env.rank, exchange.env.world_size))
        own = [path for path in paths if str(path) in mine]
        own_outcomes = zip(own, load_rank_files(own, stop_at_error=stop_at_error, tables=tables), strict=True)
        loaded = {str(path): outcome for path, outcome in own_outcomes if outcome is not None}
        found: dict[str, Any] = {}
        for part, referenced in exchange.gather((loaded, sorted(tables.referenced))):
            found.update(part)
            tables.referenced.update(referenced)  # the folder's unreferenced tables are judged on all
        outcomes: list[LoadOutcome] = []
        for path in paths:
            if outcomes and isinstance(outcomes[-1], DumpFormatError | None) and stop_at_error:
                outcomes.append(None)
                continue
            outcome = found.get(str(path))
            if outcome is None:
                raise StepFolderError(
                    f"{path}: the processes of the scaled-out check saw different rank files "
                    "(is a job still writing this step?); check it again once it is complete"
                )
            outcomes.append(outcome)
        return outcomes

    return load_files


def measure_share(exchange: Exchange) -> Callable[..., StepMeasurements]:
    """A drop-in for `measure.measure_step` that measures this process's share of the parameters
    and returns the merged measurements of all processes.

    A stats-only step (and no reference) has no tensor data to read: every process measures all of
    it, as sending the per-piece measurements costs more than computing them (a 512-rank stats
    dump: the exchange took a third of each process's time)."""
    from functools import reduce

    from .measure.measure import available_workers, bytes_to_read, measure_step

    def measure(
        step: StepDump, reader: TensorReader, *, params: Iterable[str] | None = None, **kwargs: Any
    ) -> StepMeasurements:
        kwargs.setdefault("workers", max(1, available_workers() // exchange.env.local_world_size))
        if kwargs.get("reference") is None and all(d.mode == "stats" for d in step.ranks.values()):
            return measure_step(step, reader, params=params, **kwargs)
        costs = bytes_to_read(step, kwargs.get("reference"))
        if params is not None:
            costs = {name: costs.get(name, 0) for name in params}
        mine = share_of(costs, exchange.env.rank, exchange.env.world_size)
        gathered: list[StepMeasurements] = exchange.gather(measure_step(step, reader, params=mine, **kwargs))
        return reduce(merged, gathered)

    return measure


def merged(first: StepMeasurements, second: StepMeasurements) -> StepMeasurements:
    """The measurements of disjoint parameter subsets of the same step (measured apart: each
    process of a scaled-out check measures its share) as those of one pass."""
    from .steptable import StepMeasurements

    overlap = set(first.params) & set(second.params)
    if overlap:  # each element once: a parameter measured by two processes would count twice
        raise ValueError(
            f"cannot merge measurements that both hold {sorted(overlap)[:3]}; split parameters disjointly"
        )
    references = (first.reference_table, second.reference_table)
    return StepMeasurements(
        norm_type=first.norm_type,
        params=dict(sorted({**first.params, **second.params}.items())),
        table=_joined(first.table, second.table),
        reference_table=None if None in references else _joined(*references),  # type: ignore[arg-type]
        reference_given=first.reference_given,
        reference_step=first.reference_step,
        reference_only_params=tuple(
            sorted(set(first.reference_only_params) | set(second.reference_only_params))
        ),
    )


def _joined(a: StepTable, b: StepTable) -> StepTable:
    """One step table of two of disjoint parameters of the same step, in parameter name order."""
    import numpy as np

    from .norms import UNKNOWN
    from .steptable import KindColumns, StepTable

    names = tuple(a.param_names)
    name_order = np.argsort(np.argsort(np.array(names, dtype=object), kind="stable"))
    order = np.argsort(name_order[np.concatenate([a.param, b.param])], kind="stable")

    def both(x: Any, y: Any, columns: Iterable[str]) -> dict[str, np.ndarray]:
        """The `columns` of x's entries then y's, in parameter name order."""
        return {name: np.concatenate([getattr(x, name), getattr(y, name)])[order] for name in columns}

    def kinds(x: KindColumns | None, y: KindColumns | None, flags: int = UNKNOWN) -> KindColumns:
        """The columns of one kind, `flags` set where a table lacks it (the clipped gradient's UNKNOWN,
        a call's none)."""
        x, y = x or _no_kind(a.size, flags), y or _no_kind(b.size, flags)
        return KindColumns(**both(x, y, (f.name for f in fields(KindColumns))))

    arrays = both(a, b, (f.name for f in fields(StepTable) if isinstance(getattr(a, f.name), np.ndarray)))
    arrays["layout"] = np.concatenate([a.layout, b.layout + int(a.layout.max(initial=-1)) + 1])[order]
    return StepTable(
        **arrays,
        norm_type=a.norm_type,
        param_names=names,
        dtypes=a.dtypes | b.dtypes,
        grad=kinds(a.grad, b.grad),
        clipped=None if a.clipped is b.clipped is None else kinds(a.clipped, b.clipped),
        distinct_layouts=a.distinct_layouts and b.distinct_layouts,
        calls=tuple(kinds(x, y, flags=0) for x, y in zip_longest(a.calls, b.calls)),
    )


def _no_kind(n: int, flags: int) -> KindColumns:
    """The columns of `n` entries without the kind: none held, zero statistics, these `flags`."""
    import numpy as np

    from .measure.measurements import call_columns

    rows = np.zeros((n, 1, 8))  # one all-zero call row per entry: no statistics held
    rows[:, 0, 2] = flags  # the call row's flags column
    (columns,) = call_columns(rows)
    return columns


@contextlib.contextmanager
def scaled_out(env: LaunchEnv | None) -> Iterator[Shares | None]:
    """Under torchrun: join (or create) the gloo group and give the sharing load and measure
    functions; a failure in this process is passed on to the others. Without torchrun: None (load
    and measure alone)."""
    if env is None:
        yield None
        return
    import torch.distributed as dist

    from .audit import Shares

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size, timeout=GROUP_TIMEOUT)
    exchange = Exchange(env)
    try:
        yield Shares(load_files=load_share(exchange), measure=measure_share(exchange))
    except ScaleOutError:
        raise  # already known to every process
    except Exception as exc:
        exchange.fail(exc)
        raise
    finally:
        if created:
            dist.destroy_process_group()
