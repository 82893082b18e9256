"""Runs a scenario end to end: the sharded step on its ranks, then the single-process reference."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import GradauditError
from .launch import run_ranks, run_single
from .registry import STEP, get_scenario

REFERENCE_DIR = "reference"


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
