"""Whole processes, as a user waits for them: python bench/whole.py [--quick] [--repeats N] [--workdir D]

Every figure is the wall time of a whole command (interpreter start, imports, work, exit) and the
ratio to a floor command measured in the same run, the two interleaved (floor, subject, floor,
subject, ...) so that load from other processes falls on both alike; medians of --repeats rounds.
Floors: `python -c "import numpy, typer, rich.console"` (the least a CLI built on those can cost),
`python -c "import typer, rich.console"` for --help and explain, and bench/floor_numpy.py (a
single-threaded numpy float64 read-and-square pass written from the safetensors header) for dumps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1 << 20
GIB = 1 << 30
SAMPLE = ROOT / "sample_dumps" / "fsdp2_local_clip" / "step_1"
PY = sys.executable


def run_timed_rss(command: list[str]) -> tuple[float, int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # gradaudit's bytecode cached as an installed package has it (the floors' libraries have theirs
    # in site-packages): an inherited PYTHONDONTWRITEBYTECODE=1 would recompile it in every run.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # BLAS single-threaded for floors and subjects alike, as gradaudit's main makes it for itself.
    env.update({"OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    out = process.stdout.read() if process.stdout else b""
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        raise SystemExit(f"{' '.join(command)} exited {code}")
    return seconds, usage.ru_maxrss * 1024, out.decode()


def pair(
    floor: list[str], subject: list[str], repeats: int
) -> tuple[list[float], list[float], int, int, str, str]:
    floors, subjects, floor_rss, subject_rss = [], [], 0, 0
    floor_out = subject_out = ""
    for _ in range(repeats):
        seconds, rss, floor_out = run_timed_rss(floor)
        floors.append(seconds)
        floor_rss = max(floor_rss, rss)
        seconds, rss, subject_out = run_timed_rss(subject)
        subjects.append(seconds)
        subject_rss = max(subject_rss, rss)
    return floors, subjects, floor_rss, subject_rss, floor_out, subject_out


def report(section: str, name: str, floor_name: str, result, target: float) -> None:
    floors, subjects, floor_rss, subject_rss, _, _ = result
    f, s = statistics.median(floors), statistics.median(subjects)
    ratio = s / f
    show = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    print(f"  {floor_name:<44} {f:7.2f} s (median of [{show(floors)}])  peak RSS {floor_rss / MIB:6.0f} MiB")
    print(f"  {name:<44} {s:7.2f} s (median of [{show(subjects)}])  peak RSS {subject_rss / MIB:6.0f} MiB")
    print(f"RATIO {section} {name} / {floor_name} = {ratio:.2f}")
    verdict = "MET" if ratio <= target else "NOT MET"
    print(f"TARGET {section} {name} <= {target:g}x {floor_name}: {verdict} ({ratio:.2f}x)")
    sys.stdout.flush()


def startup_section(repeats: int) -> None:
    print(f"== startup: the shipped 4-rank toy dump ({SAMPLE.relative_to(ROOT)})")
    cli_floor = [PY, "-c", "import numpy, typer, rich.console"]
    check = [PY, "-m", "gradaudit", "check", str(SAMPLE)]
    run_timed_rss(check)  # writes gradaudit's bytecode cache, which every later run reads
    report(
        "startup", "gradaudit check toy", "import numpy, typer, rich", pair(cli_floor, check, repeats), 2.0
    )
    help_floor = [PY, "-c", "import typer, rich.console"]
    for name, command in (
        ("gradaudit --help", [PY, "-m", "gradaudit", "--help"]),
        ("gradaudit explain GA201", [PY, "-m", "gradaudit", "explain", "GA201"]),
    ):
        report("startup", name, "import typer, rich", pair(help_floor, command, repeats), 1.5)


def build_in_child(kind: str, directory: Path, size: float) -> None:
    """Build a dump in a child process: a child forked from a parent holding gigabytes would count
    the parent's pages in its own peak RSS (Linux keeps the high-water mark across exec)."""
    if not directory.exists():
        subprocess.run([PY, __file__, "--build", kind, str(directory), str(size)], check=True)


def build(kind: str, directory: Path, size: float) -> None:
    if kind == "stats":
        import layouts

        layouts.write_stats_dump(directory, num_ranks=int(size))
    elif kind == "hsdp":
        import layouts

        layouts.write_replicated_stats_dump(directory, num_shards=int(size) // 8, num_replicas=8)
    elif kind == "dense":
        import layouts

        layouts.write_dense_dump(directory, num_elements=int(size * GIB) // 4, num_ranks=8)
    else:
        _write_one_param(directory, int(size))


def dense_section(workdir: Path, gib: float, repeats: int) -> None:
    directory = workdir / f"dense-fp32-{gib:g}"
    build_in_child("dense", directory, gib)
    size = sum(p.stat().st_size for p in directory.iterdir())
    print(f"== dense-fp32: 8 ranks FSDP1-style flat shards, {size / GIB:.2f} GiB")
    _warm(directory)
    floor = [PY, str(Path(__file__).with_name("floor_numpy.py")), str(directory)]
    check = [PY, "-m", "gradaudit", "check", str(directory), "--format", "json"]
    result = pair(floor, check, repeats)
    report("dense-fp32", "gradaudit check", "numpy floor", result, 1.3)
    _agree(result)


def _write_one_param(directory: Path, mib: int) -> None:
    import torch

    from gradaudit.capture.build import whole, write_rank
    from gradaudit.model import ClipRecord

    grad = torch.randn(mib * MIB // 4, generator=torch.Generator().manual_seed(0)) * 1e-3
    norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
    write_rank(
        directory,
        rank=0,
        world_size=1,
        step=1,
        params={"w": tuple(grad.shape)},
        pieces=[whole("w", grad=grad)],
        clip=ClipRecord(max_norm=1e9, reported_norm=norm, clip_coef=1.0),
        run_id="bench",
        host="bench",
        created_at="2026-01-01T00:00:00+00:00",
    )


def one_param_section(workdir: Path, mib: int, repeats: int) -> None:
    directory = workdir / f"one-param-{mib}"
    build_in_child("one-param", directory, mib)
    print(f"== one-param: 1 rank, one {mib} MiB float32 parameter")
    _warm(directory)
    floor = [PY, str(Path(__file__).with_name("floor_numpy.py")), str(directory)]
    check = [PY, "-m", "gradaudit", "check", str(directory), "--format", "json"]
    result = pair(floor, check, repeats)
    report("one-param", "gradaudit check", "numpy floor", result, 1.3)
    _agree(result)


def stats_section(workdir: Path, ladder: tuple[int, ...]) -> None:
    print(
        f"== stats: 800 parameters flat-sharded over every rank, stats only (format 1.1), ranks {list(ladder)}"
    )
    seconds: dict[int, float] = {}
    peaks: dict[int, int] = {}
    for ranks in ladder:
        directory = workdir / f"stats-{ranks}"
        build_in_child("stats", directory, ranks)
        _warm(directory)
        seconds[ranks], peaks[ranks], _ = run_timed_rss(
            [PY, "-m", "gradaudit", "check", str(directory), "--format", "json"]
        )
        print(
            f"  {ranks:5d} ranks: gradaudit check {seconds[ranks]:7.2f} s   peak RSS {peaks[ranks] / MIB:6.0f} MiB"
        )
        sys.stdout.flush()
    for small in ladder:
        if small * 4 in seconds:
            growth = seconds[small * 4] / seconds[small]
            print(f"RATIO stats check time {small * 4}/{small} ranks = {growth:.2f}")
            print(
                f"TARGET stats growth per 4x ranks <= 4.2x: {'MET' if growth <= 4.2 else 'NOT MET'} ({growth:.2f}x, {small}->{small * 4})"
            )
    top = max(ladder)
    verdict = "MET" if seconds[top] < 60 and peaks[top] < 1.5 * GIB else "NOT MET"
    print(
        f"TARGET stats {top} ranks < 60 s and < 1.5 GiB (the target is at 4096): {verdict} ({seconds[top]:.1f} s, {peaks[top] / GIB:.2f} GiB)"
    )


def replicas_section(workdir: Path, ranks: int) -> None:
    """Every piece replicated (HSDP: shards x 8 replicas, groups in every file) against the flat
    stats dump of as many ranks, both whole `check` processes, in turn."""
    print(f"== replicas: {ranks} ranks as {ranks // 8} shards x 8 replicas vs flat-sharded over {ranks}")
    flat, replicated = workdir / f"stats-{ranks}", workdir / f"hsdp-{ranks}"
    build_in_child("stats", flat, ranks)
    build_in_child("hsdp", replicated, ranks)
    seconds = {}
    for name, directory in (("flat", flat), ("replicated", replicated)):
        _warm(directory)
        seconds[name], peak, _ = run_timed_rss(
            [PY, "-m", "gradaudit", "check", str(directory), "--format", "json"]
        )
        print(f"  {name:10s} gradaudit check {seconds[name]:7.2f} s   peak RSS {peak / MIB:6.0f} MiB")
    print(f"RATIO replicated/flat check time, {ranks} ranks = {seconds['replicated'] / seconds['flat']:.2f}")


CAPTURE_SCRIPT = """
import statistics, time, torch
torch.set_num_threads(1)
from gradaudit.capture.tensorstats import stats_of_tensor
torch.manual_seed(0)
grads = [torch.randn(n) for n in [{sizes}]]
a, b = [], []
for _ in range({repeats}):
    t = time.perf_counter(); [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]; a.append(time.perf_counter() - t)
    t = time.perf_counter(); [stats_of_tensor(g, 2.0) for g in grads]; b.append(time.perf_counter() - t)
print(statistics.median(a), statistics.median(b), ",".join(f"{{x:.3f}}" for x in a), ",".join(f"{{x:.3f}}" for x in b))
"""


def capture_section(num_params: int, repeats: int) -> None:
    sizes = [1 << 20] * (num_params >> 20)
    print(
        f"== capture: stats of {len(sizes)} float32 gradients of 1M elements ({num_params * 4 / MIB:.0f} MiB), in one process"
    )
    _, _, out = run_timed_rss(
        [PY, "-c", CAPTURE_SCRIPT.format(sizes=",".join(map(str, sizes)), repeats=repeats)]
    )
    floor, subject, floors, subjects = out.split()  # medians, then each round
    ratio = float(subject) / float(floor)
    print(f"  vector_norm(g, dtype=float64) per tensor     {float(floor):7.3f} s (median of [{floors}])")
    print(f"  stats_of_tensor (sums, max, nonfinite, fp)   {float(subject):7.3f} s (median of [{subjects}])")
    print(f"RATIO capture stats / float64 norm = {ratio:.2f}")
    verdict = "MET" if ratio <= 1.5 else "NOT MET"
    print(f"TARGET capture stats <= 1.5x one float64 sum-of-squares pass: {verdict} ({ratio:.2f}x)")


def _warm(directory: Path) -> None:
    """Read every file once into the page cache, through a small buffer: a child forked from this
    process inherits its peak RSS (Linux keeps the high-water mark across exec)."""
    buffer = bytearray(MIB)
    for path in sorted(directory.iterdir()):
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def _agree(result) -> None:
    import json

    floor_out, check_out = result[4], result[5]
    norm = json.loads(check_out)["global_norm"]
    floor_norm = float(floor_out)
    same = abs(norm - floor_norm) <= 1e-9 * floor_norm
    print(f"  check norm {norm:.12g} vs floor {floor_norm:.12g}: {'agree' if same else 'DISAGREE'}")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--build":
        build(sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small dumps (a minute), for a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the dumps here and reuse them")
    parser.add_argument(
        "--full", action="store_true", help="the stats ladder in steps of 2x, 128 to 4096 ranks"
    )
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gradaudit-whole-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"gradaudit whole-process bench ({'quick' if args.quick else 'default'} sizes), {os.cpu_count()} cores"
    )
    try:
        startup_section(args.repeats)
        dense_section(workdir, 0.125 if args.quick else 1.0, max(3, args.repeats - 2))
        one_param_section(workdir, 64 if args.quick else 512, max(3, args.repeats - 2))
        capture_section((16 if args.quick else 52) << 20, 5)
        ladder = (32, 128) if args.quick else (128, 512, 1024, 2048, 4096) if args.full else (256, 1024, 4096)
        stats_section(workdir, ladder)
        replicas_section(workdir, 128 if args.quick else 1024)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
