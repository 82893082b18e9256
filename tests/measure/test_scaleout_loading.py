"""A scaled-out check loads each rank file in one process only and exchanges what it loaded: the
step every process then holds, the report rank 0 prints and every process's exit code are those of
a single-process check, also when a rank file cannot be read."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import FIXED, box, whole
from scaleout_support import REPO, TIMEOUT_S, launch, single_process

from gradaudit.capture.build import write_rank
from gradaudit.dumpfile import load_step
from gradaudit.dumpfile.loader import load_rank_files, rank_files
from gradaudit.model import ClipRecord, Topology
from gradaudit.scaleout import share_of

ROWS = {0: 40, 1: 8, 2: 8, 3: 16, 4: 8}
"""Rows of `w` per rank: rank 0's file is the largest, so shares by bytes differ from shares by count."""
OWN = {0: 6, 3: 2}
"""Unsharded parameters held by one rank only (more pieces: a larger file in a stats dump too)."""


def write_dump(directory: Path, *, stats_only: bool, local_clip: bool, own_tables: bool = False) -> Path:
    """5 ranks: `w` split by rows, unevenly; a bias replicated on every rank (compared by value, or
    by fingerprint in a stats dump); a few whole parameters on ranks 0 and 3. With `local_clip`
    every rank reports the norm of what it holds; with `own_tables` each rank lists only the
    parameters it holds (three distinct parameter tables in a stats dump)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(sum(ROWS.values()), 50, generator=gen) * 1e-2
    bias = torch.randn(50, generator=gen) * 1e-2
    own = {(r, i): torch.randn(30, generator=gen) * 1e-2 for r, n in OWN.items() for i in range(n)}
    params = {"w": tuple(w.shape), "bias": tuple(bias.shape)} | {f"own_{r}_{i}": (30,) for r, i in own}
    true_norm = float(torch.cat([w.flatten(), bias, *own.values()]).double().norm())
    start = 0
    for rank, rows in ROWS.items():
        local = [w[start : start + rows].flatten(), bias, *(g for (r, _), g in own.items() if r == rank)]
        held = {f"own_{r}_{i}" for r, i in own if r == rank}
        write_rank(
            directory,
            rank=rank,
            world_size=len(ROWS),
            step=7,
            params={n: s for n, s in params.items() if not own_tables or n in ("w", "bias") or n in held},
            pieces=[
                box("w", (start, 0), grad=w[start : start + rows], stats_only=stats_only),
                whole("bias", grad=bias, replica_group="dp", stats_only=stats_only),
                *(
                    whole(f"own_{r}_{i}", grad=g, stats_only=stats_only)
                    for (r, i), g in own.items()
                    if r == rank
                ),
            ],
            clip=ClipRecord(
                max_norm=10.0,
                reported_norm=float(torch.cat(local).double().norm()) if local_clip else true_norm,
                clip_coef=1.0,
            ),
            topology=Topology(groups={"dp": (tuple(ROWS),)}),
            **FIXED,
        )
        start += rows
    return directory


def shares_by_bytes(directory: Path, world_size: int) -> list[list[str]]:
    """The file names each process loads, as the scale-out splits them."""
    files, _ = rank_files(directory)
    costs = {str(path): path.stat().st_size for path in files}
    return [[Path(p).name for p in share_of(costs, rank, world_size)] for rank in range(world_size)]


def break_header(path: Path) -> None:
    """Make the file's gradaudit header unreadable without changing its size (the shares stay put)."""
    data = bytearray(path.read_bytes())
    data[8:16] = b"\x00" * 8
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("stats_only", [True, False], ids=["stats", "full"])
def test_a_step_loaded_in_shares_and_pickled_across_is_the_step_loaded_whole(tmp_path, stats_only):
    directory = write_dump(tmp_path / "step_7", stats_only=stats_only, local_clip=True)
    assert len({p.stat().st_size for p in directory.iterdir()}) > 1

    def load_in_two_shares(paths, *, stop_at_error=False, tables=None):
        costs = {str(p): p.stat().st_size for p in paths}
        loaded = {}
        for rank in range(2):
            mine = [p for p in paths if str(p) in share_of(costs, rank, 2)]
            outcomes = load_rank_files(mine, stop_at_error=stop_at_error, tables=tables)
            loaded.update(pickle.loads(pickle.dumps(dict(zip(map(str, mine), outcomes, strict=True)))))
        return [loaded[str(p)] for p in paths]

    assert load_step(directory, load_files=load_in_two_shares) == load_step(directory)


def test_an_unreadable_file_is_returned_in_its_place_and_the_rest_skipped_when_asked(tmp_path):
    directory = write_dump(tmp_path / "step_7", stats_only=True, local_clip=False)
    files, _ = rank_files(directory)
    break_header(files[1])
    outcomes = load_rank_files(files, stop_at_error=True)
    assert outcomes[0].rank == 0 and outcomes[2:] == [None] * 3
    assert files[1].name in str(outcomes[1])
    assert [getattr(o, "rank", None) for o in load_rank_files(files)] == [0, None, 2, 3, 4]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("stats_only", "local_clip", "format", "world_size"),
    [
        (True, False, "json", 2),
        (True, True, "markdown", 3),
        (False, False, "terminal", 2),
        (False, True, "json", 2),
    ],
    ids=["stats-clean", "stats-findings-3-processes", "full-clean", "full-findings"],
)
def test_every_process_reaches_the_single_process_report_and_exit_code(
    tmp_path, stats_only, local_clip, format, world_size
):
    directory = write_dump(tmp_path / "step_7", stats_only=stats_only, local_clip=local_clip)
    args = ["check", str(directory), "--format", format]
    single = single_process(args)
    assert single.returncode == (1 if local_clip else 0), single.stderr.decode()
    results = launch(args, world_size)
    for result in results:
        assert result.returncode == single.returncode, result.stderr.decode()
    assert results[0].stdout == single.stdout
    assert all(result.stdout == b"" for result in results[1:])


@pytest.mark.integration
def test_tables_named_only_by_another_process_share_are_not_called_unreferenced(tmp_path):
    directory = write_dump(tmp_path / "step_7", stats_only=True, local_clip=False, own_tables=True)
    assert len(list(directory.glob("params_*.safetensors"))) == 3
    (directory / "params_0123456789abcdef.safetensors").write_bytes(b"left over")
    args = ["check", str(directory), "--format", "json"]
    single = single_process(args)
    assert single.returncode == 0, single.stderr.decode()
    assert single.stdout.count(b"params_") == 1  # only the stray one is warned about
    results = launch(args)
    assert [r.returncode for r in results] == [0, 0], results[1].stderr.decode()
    assert results[0].stdout == single.stdout


def _last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.decode().strip().splitlines()[-1]


def _every_process_refuses_as_one_does(directory: Path, *, naming: str) -> str:
    """`check` exits 2 naming `naming` in one process, and every process of a scaled-out check ends
    on that same line with nothing on stdout; the single process's stderr."""
    args = ["check", str(directory), "--format", "json"]
    single = single_process(args)
    refusal = single.stderr.decode()
    assert single.returncode == 2 and naming in refusal
    for result in launch(args):
        assert (result.returncode, result.stdout) == (2, b""), result.stderr.decode()
        assert _last_line(result) == refusal.strip()
    return refusal


@pytest.mark.integration
def test_a_bad_file_in_one_process_share_stops_every_process_with_exit_2_naming_it(tmp_path):
    directory = write_dump(tmp_path / "step_7", stats_only=True, local_clip=False)
    bad = directory / shares_by_bytes(directory, 2)[1][-1]
    break_header(bad)
    assert bad.name in shares_by_bytes(directory, 2)[1]
    refusal = _every_process_refuses_as_one_does(directory, naming=bad.name)
    assert refusal.count("\n") == 1


@pytest.mark.integration
def test_with_a_bad_file_in_each_share_every_process_names_the_first_in_folder_order(tmp_path):
    directory = write_dump(tmp_path / "step_7", stats_only=False, local_clip=False)
    shares = shares_by_bytes(directory, 2)
    bad = sorted([directory / shares[0][-1], directory / shares[1][-1]])
    for path in bad:
        break_header(path)
    _every_process_refuses_as_one_does(directory, naming=bad[0].name)


@pytest.mark.integration
def test_an_unreadable_rank_in_one_process_share_is_audited_as_missing_as_by_one_process(tmp_path):
    directory = write_dump(tmp_path / "step_7", stats_only=True, local_clip=False)
    break_header(directory / shares_by_bytes(directory, 2)[1][0])
    args = ["check", str(directory), "--format", "json", "--allow-incomplete-ranks"]
    single = single_process(args)
    assert single.returncode == 1, single.stderr.decode()
    assert b"audited as a missing rank" in single.stdout
    results = launch(args)
    assert [r.returncode for r in results] == [1, 1], results[1].stderr.decode()
    assert results[0].stdout == single.stdout


@pytest.mark.integration
def test_torchrun_with_two_processes_prints_the_single_process_report(tmp_path):
    directory = write_dump(tmp_path / "step_7", stats_only=True, local_clip=True)
    args = ["check", str(directory), "--format", "json"]
    single = single_process(args)
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "gradaudit", *args],
        cwd=REPO,
        capture_output=True,
        timeout=TIMEOUT_S,
    )
    assert single.returncode == 1
    assert torchrun.returncode != 0, torchrun.stderr.decode()  # torchrun reports a failed child as 1
    assert torchrun.stdout == single.stdout
