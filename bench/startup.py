"""Start-up of the command line: whole processes against the floors of a CLI built on the same libraries.

    python bench/startup.py [--repeats 9]

Every subject is a fresh `python` process timed from spawn to exit (what a user waits for). Subjects are
interleaved (floor, subject, floor, subject, ...) so that a busy machine slows both sides alike; the
medians are compared as ratios measured in this run and printed as TARGET lines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE = "sample_dumps/fsdp2_correct"
"""A shipped 2-rank sample, passed as its folder (step_1 and its reference) as a user would."""

BLAS_SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""What gradaudit's `main` sets before numpy loads (cli._single_threaded_blas)."""

FLOOR_CLI = "floor: import typer, rich.console"
FLOOR_NUMPY_CLI = "floor: import numpy, typer, rich.console"
TYPER_COERCION = "reference: the floor + typer's pydantic coercion"
"""Not a target: what typer's pydantic coercion of every parsed parameter costs; `check` no longer pays
it (gradaudit/cliparams.py converts its parameters without pydantic)."""
HELP = "gradaudit --help"
EXPLAIN = "gradaudit explain GA201"
CHECK = f"gradaudit check {SAMPLE}"
SUBJECTS: dict[str, tuple[str, ...]] = {
    FLOOR_CLI: ("-c", "import typer, rich.console"),
    FLOOR_NUMPY_CLI: ("-c", "import numpy, typer, rich.console"),
    TYPER_COERCION: ("-c", "import numpy, typer, rich.console, typer._adapters"),
    HELP: ("-m", "gradaudit", "--help"),
    EXPLAIN: ("-m", "gradaudit", "explain", "GA201"),
    CHECK: ("-m", "gradaudit", "check", SAMPLE),
}


@dataclass(frozen=True, kw_only=True)
class Target:
    label: str
    subject: str
    floor: str | None
    """None: an absolute limit in seconds rather than a ratio."""
    limit: float


TARGETS = (
    Target(label="--help vs typer+rich floor", subject=HELP, floor=FLOOR_CLI, limit=1.5),
    Target(label="explain vs typer+rich floor", subject=EXPLAIN, floor=FLOOR_CLI, limit=1.5),
    Target(label="check sample vs numpy+typer+rich floor", subject=CHECK, floor=FLOOR_NUMPY_CLI, limit=2.0),
    Target(label="check sample wall seconds (idle machine)", subject=CHECK, floor=None, limit=0.5),
)


def subject_env() -> dict[str, str]:
    """The environment of every subject: gradaudit from this checkout, with its bytecode cached as an
    installed package has it (the floors' libraries have theirs in site-packages). Without this, a
    PYTHONDONTWRITEBYTECODE=1 inherited from the shell recompiles every gradaudit module in every run.
    BLAS is single-threaded for every subject, as gradaudit makes it for itself: otherwise the floor
    alone pays for starting OpenBLAS's threads, which on a busy machine flatters the ratio."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(BLAS_SINGLE_THREADED)
    return env


def time_process(args: tuple[str, ...]) -> float:
    env = subject_env()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}: {done.stderr.decode(errors='replace')}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="rounds of interleaved runs (median taken)")
    args = parser.parse_args()
    for command in SUBJECTS.values():
        time_process(command)  # warm the file cache and the bytecode cache
    times: dict[str, list[float]] = {name: [] for name in SUBJECTS}
    for _ in range(args.repeats):
        for name, command in SUBJECTS.items():
            times[name].append(time_process(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"== startup ({args.repeats} interleaved rounds, whole processes, median seconds)")
    for name, values in times.items():
        print(f"{name:<50} {medians[name]:7.3f}   runs: {' '.join(f'{v:.3f}' for v in values)}")
    for target in TARGETS:
        value = (
            medians[target.subject]
            if target.floor is None
            else medians[target.subject] / medians[target.floor]
        )
        unit = "s" if target.floor is None else "x"
        verdict = "MET" if value <= target.limit else f"MISSED by {100 * (value / target.limit - 1):.0f}%"
        relation = "<=" if value <= target.limit else ">"
        spread = (
            "" if target.floor is None else f"; {round_ratios(times[target.subject], times[target.floor])}"
        )
        print(
            f"TARGET {target.label}: {verdict} ({value:.2f}{unit} {relation} {target.limit:g}{unit}{spread})"
        )


def round_ratios(subject: list[float], floor: list[float]) -> str:
    """The ratio of the subject to the floor within each round: how far one round's load moves
    the ratio of the medians, which is the target."""
    ratios = sorted(s / f for s, f in zip(subject, floor, strict=True))
    return f"rounds {ratios[0]:.2f}x-{ratios[-1]:.2f}x, median {statistics.median(ratios):.2f}x"


if __name__ == "__main__":
    main()
