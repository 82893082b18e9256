"""The benchmark must keep running: tiny sizes, every section, no timing asserted."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import layouts  # noqa: E402
import run  # noqa: E402

RATIO = re.compile(r"^RATIO (\S+) (.+) = (n/a|[0-9.]+)$", re.M)


def test_tiny_bench_runs_every_section_and_prints_its_ratios_and_targets(tmp_path, capsys):
    assert run.main(["--tiny", "--in-process", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    ratios = {(m.group(1), m.group(2)): m.group(3) for m in RATIO.finditer(out)}
    for section in ("dense-fp32", "dense-bf16"):
        for what in ("check/floor time", "naive/floor time", "check peak RSS/largest file"):
            assert ratios[(section, what)] != "n/a", f"{section} {what} was not measured:\n{out}"
    assert ratios[("stats", "check time 8 ranks/2 ranks")] != "n/a"
    assert ratios[("capture", "audit_step full/save_file time")] != "n/a"
    assert ratios[("capture", "audit_step stats/full time")] != "n/a"
    assert ratios[("coverage", "grid time 1000/100 pieces")] != "n/a"
    for mode in ("full", "stats"):
        assert ratios[("params", f"{mode} time 1000/100 params beyond linear")] != "n/a"
    assert ratios[("params", "stats 1000/norm loop 1000 time")] != "n/a"
    assert "DISAGREE" not in out and out.count(": agree") == 2
    summary = out.split("== targets\n", 1)[1]
    assert len(re.findall(r"^TARGET .*: (MET|MISSED by \d+%) ", summary, re.M)) == 12, summary


def test_a_subject_in_its_own_process_reports_its_time_and_peak_memory(tmp_path):
    layout = layouts.write_dense_dump(tmp_path / "dense", num_elements=20_000, num_ranks=2)
    result = harness.run_subject("floor", {"directory": str(layout.directory)})
    assert result.error is None
    assert result.seconds > 0 and result.peak_rss_bytes > 10 * harness.MIB
    assert result.value == pytest.approx(layout.true_norm, rel=1e-12)


def test_fast_stats_writer_gives_the_same_dumps_as_the_project_writer(tmp_path):
    from gradaudit.dumpfile import load_rank_file
    from gradaudit.dumpfile.writer import write_rank_file

    layouts.write_stats_dump(tmp_path / "fast", num_ranks=6, num_params=12)
    reference = layouts._stats_rank_dumps(num_ranks=6, num_params=12, seed=0)
    for rank in range(6):
        written = write_rank_file(tmp_path / "reference", reference.dump(rank), {})
        fast = load_rank_file(tmp_path / "fast" / written.name)
        slow = load_rank_file(written)
        assert dataclasses.replace(fast, path="") == dataclasses.replace(slow, path="")
        assert fast.num_bytes == slow.num_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_numpy_floor_reads_the_safetensors_files_itself_and_finds_the_true_norm(tmp_path, dtype):
    import floor_numpy

    layout = layouts.write_dense_dump(tmp_path / dtype, num_elements=70_000, num_ranks=3, dtype=dtype)
    assert floor_numpy.main(str(layout.directory)) == pytest.approx(layout.true_norm, rel=1e-12)


def test_the_guards_scale_bench_judges_generated_worlds_and_prints_their_bytes(capsys):
    import guard_scale

    assert guard_scale.main(["--ranks", "64", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "== 64 ranks: bytes per rank per collective: sum " in out
    for what in (
        "common path / 1 ms target",
        "failing step / 1 s target",
        "failing step memory / 1 GiB target",
    ):
        assert re.search(rf"^RATIO 64 ranks {what} = [0-9.]+ ", out, re.M), out


def test_the_gpu_bench_skips_without_a_cuda_device(capsys):
    import gpu_guard
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: run bench/gpu_guard.py itself")
    assert gpu_guard.main(["--tiny"]) == 0
    assert capsys.readouterr().out.startswith("SKIP: no CUDA device")
