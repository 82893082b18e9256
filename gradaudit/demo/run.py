"""Runs a scenario end to end: the sharded step on its ranks, then the single-process reference."""

from __future__ import annotations

import importlib
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GradauditError
from ..localranks import DEFAULT_TIMEOUT_S, launch
from .registry import STEP, get_scenario

REFERENCE_DIR = "reference"


class DemoRunFailed(RuntimeError):
    """A process of a demo scenario raised, died or hung: a bug in the scenario or an unusable machine.

    The message is one line; `detail` holds the failing process's whole traceback, when there is one.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        last_line = detail.strip().splitlines()[-1] if detail.strip() else ""
        super().__init__(f"{message}: {last_line}" if last_line else message)
        self.detail = detail


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What a scenario's per-rank function receives inside its process, after the group is up."""

    rank: int
    """This process's global rank."""
    world_size: int
    """Ranks of the scenario."""
    out_dir: Path
    """Where the sharded dump goes (audit_step writes out_dir/step_<N>/)."""


class DemoOutputExists(GradauditError):
    """The output folder already holds this scenario's dumps; the demo never overwrites them."""


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    step_dir: Path
    """The sharded dump: OUT_DIR/<scenario>/step_<N>/, one file per rank."""
    reference_step_dir: Path
    """The single-process reference: OUT_DIR/<scenario>/reference/step_<N>/."""

    @property
    def check_command(self) -> str:
        return (
            f"gradaudit check {shlex.quote(str(self.step_dir))} "
            f"--reference {shlex.quote(str(self.reference_step_dir))}"
        )


def scenario_dirs(out_dir: Path, name: str) -> tuple[Path, Path]:
    """Where a scenario's dumps go: OUT_DIR/<name>/ for the sharded run, OUT_DIR/<name>/reference/."""
    return out_dir / name, out_dir / name / REFERENCE_DIR


def run_demo(
    name: str,
    out_dir: Path,
    *,
    progress: Callable[[str], None] = lambda line: None,
) -> DemoResult:
    """Run scenario `name` and write its sharded and reference dumps under `out_dir/name`.

    `progress` receives a line before each of the two runs (the CLI prints it on stderr).
    """
    scenario = get_scenario(name)
    sharded_root, reference_root = scenario_dirs(Path(out_dir), name)
    result = DemoResult(
        step_dir=sharded_root / f"step_{STEP}",
        reference_step_dir=reference_root / f"step_{STEP}",
    )
    for folder in (result.step_dir, result.reference_step_dir):
        if folder.exists():
            raise DemoOutputExists(
                f"{folder}: already exists; gradaudit demo never overwrites a dump: "
                "choose another OUT_DIR or delete that folder first"
            )
    module = f"{__package__}.scenarios.{scenario.name}"
    progress(f"running {name} on {scenario.world_size} gloo ranks (CPU)...")
    run_ranks(f"{module}:train_rank", world_size=scenario.world_size, out_dir=sharded_root)
    progress("running its unsharded reference in one process...")
    run_single(f"{module}:train_reference", out_dir=reference_root)
    return result


def run_ranks(target: str, *, world_size: int, out_dir: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Call `target(ctx)` ("module:function", resolved inside the process, so that the caller never
    imports torch) on `world_size` local gloo ranks; DemoRunFailed names the rank that failed first."""
    _run(_rank_process, world_size, (target, str(out_dir)), timeout_s, init_group=True)


def run_single(target: str, *, out_dir: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Call `target(out_dir)` in one fresh process with no process group (the unsharded reference)."""
    _run(_reference_process, 1, (target, str(out_dir)), timeout_s, init_group=False)


def _run(
    fn: Callable[..., None], nprocs: int, args: tuple[Any, ...], timeout_s: float, *, init_group: bool
) -> None:
    outcomes = launch(fn, nprocs, args, timeout_s=timeout_s, init_group=init_group)
    failed = sorted(
        (o for o in outcomes if o.status != "ok"), key=lambda o: (o.reported is None, o.reported or 0, o.rank)
    )
    if failed:
        first = failed[0]
        how = "failed" if first.status == "raised" else first.message
        raise DemoRunFailed(f"demo process {first.rank} of {nprocs} {how}", first.traceback)


def _resolve(target: str) -> Callable[..., None]:
    module_name, _, function_name = target.partition(":")
    function: Callable[..., None] = getattr(importlib.import_module(module_name), function_name)
    return function


def _reference_process(index: int, nprocs: int, target: str, out_dir: str) -> None:
    _resolve(target)(Path(out_dir))


def _rank_process(rank: int, world_size: int, target: str, out_dir: str) -> None:
    import torch.distributed as dist

    _resolve(target)(RankContext(rank=rank, world_size=world_size, out_dir=Path(out_dir)))
    dist.barrier()  # no rank leaves the group while a peer still works in it
