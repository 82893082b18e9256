"""A scaled-out check against one process, as whole processes: python bench/scaleout.py [--nproc N] [--repeats R] [--baseline ROOT] DIR...

For each step folder, `torchrun --standalone --nproc-per-node N -m gradaudit check DIR --format json`
and `python -m gradaudit check DIR --format json`, interleaved (one, torchrun, one, torchrun, ...)
after one warm-up run, so that load from other processes falls on both alike; medians of --repeats
rounds; with --baseline, also torchrun on the gradaudit checkout at ROOT (e.g. an older commit) in
the same rounds. Wall time is what a user waits for; CPU time is that of the whole process tree (torchrun,
its processes and their threads), what the scale-out costs in all. The two reports must be equal
byte for byte, or the bench stops.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str], root: Path = ROOT) -> tuple[float, float, bytes]:
    """Wall and CPU seconds of `command` and everything it started, and its standard output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(root)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1) and not (command[1:3] == ["-m", "torch.distributed.run"]):
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another gradaudit checkout, run under torchrun too")
    args = parser.parse_args()
    for directory in args.directories:
        check = ["-m", "gradaudit", "check", str(directory), "--format", "json"]
        one = [sys.executable, *check]
        many = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        many += ["--nproc-per-node", str(args.nproc), *check]
        run(one)
        subjects = [("one", one, ROOT), ("torchrun", many, ROOT)]
        if args.baseline is not None:
            subjects.append(("baseline", many, args.baseline.resolve()))
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in subjects}
        for _ in range(args.repeats):
            for name, command, root in subjects:
                wall, cpu, out = run(command, root)
                rounds[name].append((wall, cpu))
                if name == "one":
                    expected = out
                elif out != expected:
                    raise SystemExit(f"{directory}: {name}'s report differs from one process's")
        print(f"== {directory}: torchrun --nproc-per-node {args.nproc} vs one process, {args.repeats} rounds")
        medians = {}
        for name, samples in rounds.items():
            walls, cpus = [w for w, _ in samples], [c for _, c in samples]
            medians[name] = statistics.median(walls), statistics.median(cpus)
            shown = ", ".join(f"{w:.2f}" for w in walls)
            print(f"  {name:<9} wall {medians[name][0]:6.2f} s [{shown}]  CPU {medians[name][1]:6.2f} s")
        wall_ratio = medians["torchrun"][0] / medians["one"][0]
        cpu_ratio = medians["torchrun"][1] / medians["one"][1]
        print(f"RATIO torchrun/one wall = {wall_ratio:.2f}  CPU = {cpu_ratio:.2f}  (reports identical)")
        if args.baseline is not None:
            old_wall, old_cpu = medians["baseline"]
            print(
                f"RATIO torchrun/baseline torchrun wall = {medians['torchrun'][0] / old_wall:.2f}  "
                f"CPU = {medians['torchrun'][1] / old_cpu:.2f}"
            )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
