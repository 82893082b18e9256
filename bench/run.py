"""gradaudit's benchmark: builds synthetic dumps with the project's writer and prints, from one run on
the same files, the cost of the check and of the capture as ratios against baselines measured in
the same run. See bench/README.md.

    python bench/run.py            # default sizes, under 10 minutes on 2 cores
    python bench/run.py --full     # the issue's target sizes (the 4096-rank ladder takes longer)
"""

from __future__ import annotations

import argparse
import itertools
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
import layouts
from harness import MIB, Summary

GIB = 1 << 30

TARGET_CHECK_VS_FLOOR = 1.3
TARGET_RSS_FILE_FACTOR = 2.0
TARGET_RSS_SLACK_MIB = 300
TARGET_STATS_SECONDS = 60.0
TARGET_STATS_RANKS = 4096
TARGET_STATS_GROWTH = 4.5
TARGET_AUDIT_FULL_VS_SAVE = 1.3
TARGET_STATS_VS_FULL = 0.05
TARGET_PARAMS_GROWTH = 1.2
"""10x the parameters of a rank: capture time at most 1.2x beyond linear (12x)."""
TARGET_PARAMS_STATS_VS_NORMS = 1.5
TARGET_COVERAGE_GROWTH = 20.0
"""10x the pieces: n log n gives about 11-13x, quadratic 100x."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    dense_gib: float
    bf16_gib: float
    dense_ranks: int
    stats_ranks: tuple[int, ...]
    stats_pieces: int
    capture_params: int
    many_params: tuple[int, ...]
    coverage_pieces: tuple[int, int]
    repeats: int
    stats_repeats: int


DEFAULT = Sizes(
    dense_gib=2.0,
    bf16_gib=2.0,
    dense_ranks=8,
    stats_ranks=(64, 128, 256, 512),
    stats_pieces=800,
    capture_params=100_000_000,
    many_params=(1_000, 10_000, 100_000),
    coverage_pieces=(10_000, 100_000),
    repeats=3,
    stats_repeats=1,
)
FULL = Sizes(
    dense_gib=2.0,
    bf16_gib=2.0,
    dense_ranks=8,
    stats_ranks=(512, 1024, 2048, 4096),
    stats_pieces=800,
    capture_params=100_000_000,
    many_params=(1_000, 10_000, 100_000),
    coverage_pieces=(10_000, 100_000),
    repeats=3,
    stats_repeats=1,
)
TINY = Sizes(
    dense_gib=2 / 1024,
    bf16_gib=2 / 1024,
    dense_ranks=8,
    stats_ranks=(2, 4, 8),
    stats_pieces=20,
    capture_params=200_000,
    many_params=(10, 100, 1_000),
    coverage_pieces=(100, 1_000),
    repeats=1,
    stats_repeats=1,
)
SECTIONS = ("dense", "bf16", "stats", "capture", "params", "coverage")


# ---------------------------------------------------------------- printing


class Printer:
    """Lines of the benchmark's output; every target line is also kept for the closing summary."""

    def __init__(self) -> None:
        self.targets: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, flush=True)

    def ratio(self, section: str, what: str, value: float | None) -> None:
        self.line(f"RATIO {section} {what} = {'n/a' if value is None else f'{value:.3f}'}")

    def target(self, label: str, value: float | None, limit: float, unit: str, why_missing: str = "") -> None:
        if value is None:
            text = f"TARGET {label}: NOT MEASURED ({why_missing or 'subject failed'})"
        elif value <= limit:
            text = f"TARGET {label}: MET ({_fmt(value, unit)} <= {_fmt(limit, unit)})"
        else:
            text = f"TARGET {label}: MISSED by {100 * (value / limit - 1):.0f}% ({_fmt(value, unit)} > {_fmt(limit, unit)})"
        self.targets.append(text)
        self.line(text)

    def subject(self, summary: Summary, extra: str = "") -> None:
        if not summary.ok:
            self.line(f"  {summary.name:<24} FAILED: {summary.error}")
            return
        times = ", ".join(f"{r.seconds:.2f}" for r in summary.runs)
        self.line(
            f"  {summary.name:<24} {summary.seconds:8.2f} s (median of [{times}])   "
            f"peak RSS {summary.peak_rss_bytes / MIB:8.0f} MiB{extra}"
        )


def _fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "s":
        return f"{value:.1f} s"
    if unit == "MiB":
        return f"{value:.0f} MiB"
    return f"{value:.3g}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# ---------------------------------------------------------------- sections


def prepared(workdir: Path, key: str, build, **kwargs) -> tuple[Path, object]:
    """`build(directory, **kwargs)` run once per workdir and key (reused with --workdir), in a spawned
    process: building holds the whole dump in memory, and a subject forked from a large parent would
    report the parent's resident memory as its own peak."""
    import multiprocessing
    import pickle

    directory = workdir / key
    marker = directory / ".layout.pickle"
    if marker.exists():
        return directory, pickle.loads(marker.read_bytes())
    if directory.exists():
        shutil.rmtree(directory)
    started = time.perf_counter()
    if harness.IN_PROCESS:
        layout = build(directory, **kwargs)
    else:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            layout = pool.apply(build, (directory,), kwargs)
    marker.write_bytes(pickle.dumps(layout))
    print(f"  (built {key} in {time.perf_counter() - started:.1f} s)", flush=True)
    return directory, layout


def dense_section(out: Printer, workdir: Path, sizes: Sizes, dtype: str, gib: float) -> None:
    section = f"dense-{'fp32' if dtype == 'float32' else 'bf16'}"
    elements = int(gib * GIB) // (4 if dtype == "float32" else 2)
    directory, layout = prepared(
        workdir,
        f"{section}-{elements}-{sizes.dense_ranks}",
        layouts.write_dense_dump,
        num_elements=elements,
        num_ranks=sizes.dense_ranks,
        dtype=dtype,
    )
    out.line(
        f"== {section}: {layout.num_ranks} ranks FSDP1-style flat shards, {layout.total_bytes / GIB:.2f} GiB, "
        f"{layout.num_elements:,} {dtype} elements in {layout.num_params} params, largest file "
        f"{layout.largest_file_bytes / MIB:.1f} MiB"
    )
    harness.warm_page_cache(directory)
    args = {"directory": str(directory)}
    results = harness.interleaved(
        {"floor": dict(args), "check": dict(args), "naive": dict(args, _repeats=1)}, sizes.repeats
    )
    largest = layout.largest_file_bytes
    for summary in results.values():
        extra = "" if not summary.ok else f" ({summary.peak_rss_bytes / largest:.2f}x largest file)"
        out.subject(summary, extra)
    floor, check, naive = results["floor"], results["check"], results["naive"]
    if floor.ok and check.ok:
        agree = abs(check.value - floor.value) <= 1e-9 * floor.value
        out.line(
            f"  check norm {check.value:.12g} vs floor {floor.value:.12g}: {'agree' if agree else 'DISAGREE'}"
        )
    out.ratio(section, "check/floor time", _ratio(check.seconds, floor.seconds))
    out.ratio(section, "naive/floor time", _ratio(naive.seconds, floor.seconds))
    out.ratio(section, "check/naive time", _ratio(check.seconds, naive.seconds))
    for summary in (floor, check, naive):
        out.ratio(section, f"{summary.name} peak RSS/largest file", _ratio(summary.peak_rss_bytes, largest))
    rss_limit = (TARGET_RSS_FILE_FACTOR * largest) / MIB + TARGET_RSS_SLACK_MIB
    scale = "" if gib >= 2.0 else f" [at {gib:g} GiB, target is 2 GiB: run --full]"
    out.target(
        f"{section} check time <= {TARGET_CHECK_VS_FLOOR}x floor{scale}",
        _ratio(check.seconds, floor.seconds),
        TARGET_CHECK_VS_FLOOR,
        "x",
        check.error or "",
    )
    out.target(
        f"{section} check peak RSS <= 2 x largest file + 300 MiB{scale}",
        None if check.peak_rss_bytes is None else check.peak_rss_bytes / MIB,
        rss_limit,
        "MiB",
        check.error or "",
    )


def stats_section(out: Printer, workdir: Path, sizes: Sizes, *, skip_load_subject: bool = False) -> None:
    out.line(
        f"== stats-only ladder: {sizes.stats_pieces} params (Llama-70B-like), each flat-sharded over every rank"
    )
    seconds: dict[int, float | None] = {}
    for num_ranks in sizes.stats_ranks:
        directory, layout = prepared(
            workdir,
            f"stats-{num_ranks}x{sizes.stats_pieces}",
            layouts.write_stats_dump,
            num_ranks=num_ranks,
            num_params=sizes.stats_pieces,
        )
        out.line(
            f" {num_ranks} ranks x {sizes.stats_pieces} pieces ({layout.num_elements / 1e9:.1f}e9 elements): "
            f"{layout.total_bytes / MIB:.0f} MiB of headers, {layout.largest_file_bytes / 1024:.0f} KiB per file"
        )
        args = {"directory": str(directory)}
        subjects = {"check": dict(args)}
        if not skip_load_subject:
            subjects = {"load headers": dict(args, _subject="load_headers"), **subjects}
        results = harness.interleaved(subjects, sizes.stats_repeats)
        for summary in results.values():
            out.subject(summary)
        seconds[num_ranks] = results["check"].seconds
    ladder = sizes.stats_ranks
    smallest_known = [n for n in ladder if seconds.get(n)]
    for n in ladder[1:]:
        out.ratio("stats", f"check time {n} ranks/{ladder[0]} ranks", _ratio(seconds[n], seconds[ladder[0]]))
    largest, quarter = ladder[-1], ladder[-1] // 4
    growth = _ratio(seconds.get(largest), seconds.get(quarter)) if quarter in seconds else None
    scale = (
        ""
        if largest == TARGET_STATS_RANKS
        else f" [measured {largest} vs {quarter}; target is 4096 vs 1024: run --full]"
    )
    out.target(
        f"stats check time growth {largest}/{quarter} ranks <= {TARGET_STATS_GROWTH}x{scale}",
        growth,
        TARGET_STATS_GROWTH,
        "x",
    )
    if largest == TARGET_STATS_RANKS:
        out.target(
            f"stats check of 4096 ranks x {sizes.stats_pieces} pieces < 60 s",
            seconds.get(largest),
            TARGET_STATS_SECONDS,
            "s",
        )
    elif smallest_known:
        estimate = None if seconds.get(largest) is None else seconds[largest] * TARGET_STATS_RANKS / largest
        out.line(f"  linear estimate for 4096 ranks from {largest}: {estimate:.1f} s" if estimate else "")
        out.target(
            f"stats check of 4096 ranks < 60 s [estimated linearly from {largest} ranks; run --full]",
            estimate,
            TARGET_STATS_SECONDS,
            "s",
        )


def capture_section(out: Printer, workdir: Path, sizes: Sizes) -> None:
    out.line(
        f"== capture: a {sizes.capture_params / 1e6:.0f}M-parameter fp32 model, gradients from one backward"
    )
    args = {"num_params": sizes.capture_params, "workdir": str(workdir / "capture")}
    results = harness.interleaved(
        {
            "save_file": dict(args),
            "audit_step full": dict(args, mode="full", _subject="audit_step"),
            "audit_step stats": dict(args, mode="stats", _subject="audit_step"),
        },
        sizes.repeats,
    )
    for summary in results.values():
        out.subject(summary)
    save, full, stats = results["save_file"], results["audit_step full"], results["audit_step stats"]
    out.ratio("capture", "audit_step full/save_file time", _ratio(full.seconds, save.seconds))
    out.ratio("capture", "audit_step stats/full time", _ratio(stats.seconds, full.seconds))
    scale = "" if sizes.capture_params >= 100_000_000 else " [model under 100M parameters]"
    out.target(
        f"audit_step full <= {TARGET_AUDIT_FULL_VS_SAVE}x save_file{scale}",
        _ratio(full.seconds, save.seconds),
        TARGET_AUDIT_FULL_VS_SAVE,
        "x",
        full.error or save.error or "",
    )
    out.target(
        f"audit_step stats < 5% of full{scale}",
        _ratio(stats.seconds, full.seconds),
        TARGET_STATS_VS_FULL,
        "x",
        stats.error or full.error or "",
    )


def params_section(out: Printer, workdir: Path, sizes: Sizes) -> None:
    counts = sizes.many_params
    rounds = max(sizes.repeats, 1)
    out.line(
        f"== many parameters per rank: {', '.join(f'{n:,}' for n in counts)} parameters of 4 fp32 elements, "
        f"one process, {rounds} interleaved round(s) of: vector_norm loop, stats, loop again, full"
    )
    args = {
        "counts": list(counts),
        "workdir": str(workdir / "params"),
        "rounds": rounds,
        "modes": ["stats", "full"],
    }
    run_ = harness.run_subject("params_ladder", args, timeout_s=3600.0)
    if run_.error is not None:
        out.line(f"  params ladder FAILED: {run_.error}")
    times: dict[str, list[float]] = run_.value or {}
    results = {
        name: Summary(
            name=name,
            runs=tuple(harness.Run(seconds=s, peak_rss_bytes=run_.peak_rss_bytes) for s in seconds),
        )
        for name, seconds in times.items()
        if not name.startswith("stats/loop")
    }
    for summary in results.values():
        out.subject(summary)
    for mode in ("full", "stats"):
        worst = None
        for small, large in itertools.pairwise(counts):
            growth = _ratio(_seconds(results, f"{mode} {large}"), _seconds(results, f"{mode} {small}"))
            beyond = None if growth is None else growth / (large / small)
            out.ratio("params", f"{mode} time {large}/{small} params beyond linear", beyond)
            if beyond is not None:
                worst = beyond if worst is None else max(worst, beyond)
        out.target(
            f"{mode} capture growth per 10x parameters <= {TARGET_PARAMS_GROWTH}x beyond linear",
            worst,
            TARGET_PARAMS_GROWTH,
            "x",
        )
    for n in counts:
        paired = times.get(f"stats/loop {n}", [])
        if paired:
            rounds_text = ", ".join(f"{r:.2f}" for r in paired)
            out.line(
                f"  stats/norm loop {n:,}: median {statistics.median(paired):.2f}x (per round: {rounds_text})"
            )
    largest = counts[-1]
    paired = times.get(f"stats/loop {largest}")
    vs_norms = statistics.median(paired) if paired else None
    out.ratio("params", f"stats {largest}/norm loop {largest} time", vs_norms)
    scale = "" if largest >= 100_000 else " [under 10^5 parameters]"
    out.target(
        f"stats capture of {largest:,} tensors <= {TARGET_PARAMS_STATS_VS_NORMS}x a vector_norm loop "
        f"[median of rounds, same process]{scale}",
        vs_norms,
        TARGET_PARAMS_STATS_VS_NORMS,
        "x",
    )


def _seconds(results: dict[str, Summary], name: str) -> float | None:
    summary = results.get(name)
    return None if summary is None else summary.seconds


def coverage_section(out: Printer, sizes: Sizes) -> None:
    small, large = sizes.coverage_pieces
    out.line(f"== ownership coverage (GA102/GA103 sweep): {small:,} vs {large:,} pieces of one parameter")
    subjects = {}
    for layout in ("flat", "grid", "replicated"):
        for pieces in (small, large):
            subjects[f"{layout} {pieces}"] = {"_subject": "coverage", "layout": layout, "num_pieces": pieces}
    results = harness.interleaved(subjects, 1)
    worst = None
    for layout in ("flat", "grid", "replicated"):
        a, b = results[f"{layout} {small}"], results[f"{layout} {large}"]
        out.subject(a)
        out.subject(b)
        growth = _ratio(b.seconds, a.seconds)
        out.ratio("coverage", f"{layout} time {large}/{small} pieces", growth)
        if growth is not None:
            worst = growth if worst is None else max(worst, growth)
    out.target(
        f"coverage time growth for 10x pieces <= {TARGET_COVERAGE_GROWTH:g}x (n log n ~ 12x, n^2 = 100x)",
        worst,
        TARGET_COVERAGE_GROWTH,
        "x",
    )


# ---------------------------------------------------------------- main


def machine_line() -> str:
    import os

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return f"machine: {os.cpu_count()} cores ({cpu}), {memory:.0f} GiB RAM, {platform.python_implementation()} {platform.python_version()}"


def parse(argv: list[str]) -> tuple[argparse.Namespace, Sizes]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--full", action="store_true", help="the issue's target sizes (4096-rank stats ladder)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes, seconds in all (the smoke test)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    parser.add_argument("--dense-gib", type=float, help="size of the fp32 dump")
    parser.add_argument("--bf16-gib", type=float, help="size of the bf16 dump")
    parser.add_argument(
        "--stats-ranks",
        help="comma-separated rank counts of the stats ladder (the last is compared with last/4)",
    )
    parser.add_argument("--stats-pieces", type=int, help="parameters (pieces per rank) of the stats dumps")
    parser.add_argument("--capture-params", type=float, help="parameters of the capture model")
    parser.add_argument(
        "--skip-load-subject",
        action="store_true",
        help="stats ladder: time only the check, not also the loader alone (saves a third)",
    )
    parser.add_argument("--repeats", type=int, help="rounds of interleaved runs (median taken)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run subjects in this process (fast, for the smoke test; peak RSS figures are then meaningless)",
    )
    parser.add_argument("--workdir", type=Path, help="keep dumps here and reuse them on the next run")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL if args.full else DEFAULT
    overrides = {
        "dense_gib": args.dense_gib,
        "bf16_gib": args.bf16_gib,
        "stats_ranks": tuple(int(n) for n in args.stats_ranks.split(",")) if args.stats_ranks else None,
        "stats_pieces": args.stats_pieces,
        "capture_params": int(args.capture_params) if args.capture_params else None,
        "repeats": args.repeats,
    }
    import dataclasses

    sizes = dataclasses.replace(sizes, **{k: v for k, v in overrides.items() if v is not None})
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args, sizes


def main(argv: list[str] | None = None) -> int:
    args, sizes = parse(sys.argv[1:] if argv is None else argv)
    harness.IN_PROCESS = args.in_process
    try:
        return _run_sections(args, sizes)
    finally:
        harness.IN_PROCESS = False


def _run_sections(args: argparse.Namespace, sizes: Sizes) -> int:
    sections = args.sections.split(",")
    out = Printer()
    started = time.perf_counter()
    out.line(
        f"gradaudit bench ({'full' if args.full else 'tiny' if args.tiny else 'default'} sizes): {sizes}"
    )
    out.line(machine_line())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gradaudit-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if "dense" in sections:
            dense_section(out, workdir, sizes, "float32", sizes.dense_gib)
        if "bf16" in sections:
            dense_section(out, workdir, sizes, "bfloat16", sizes.bf16_gib)
        if "stats" in sections:
            stats_section(out, workdir, sizes, skip_load_subject=args.skip_load_subject)
        if "capture" in sections:
            capture_section(out, workdir, sizes)
        if "params" in sections:
            params_section(out, workdir, sizes)
        if "coverage" in sections:
            coverage_section(out, sizes)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    out.line("== targets")
    for text in out.targets:
        out.line(text)
    out.line(f"bench finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
