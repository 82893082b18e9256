"""`gradaudit demo` as a command: listing, usage errors, refusing to overwrite, and failing ranks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gradaudit.demo import SCENARIOS, scenario_names
from gradaudit.demo.run import DemoRunFailed, RankContext, run_ranks, run_single


def test_demo_list_names_every_scenario_with_its_ranks_and_mistake(cli):
    code, out, _ = cli("demo", "--list")
    assert code == 0
    lines = out.splitlines()
    for scenario in SCENARIOS:
        assert any(line.split()[:3] == [scenario.name, str(scenario.world_size), "ranks"] for line in lines)
        assert f"mistake: {scenario.mistake}" in out


def test_scenario_names_are_unique_folder_names():
    names = scenario_names()
    assert len(set(names)) == len(names) == 9
    assert all(name.isidentifier() for name in names)


def test_demo_without_arguments_is_a_usage_error(cli):
    code, out, err = cli("demo")
    assert code == 2 and out == ""
    assert "gradaudit demo SCENARIO OUT_DIR" in err


def test_demo_of_an_unknown_scenario_lists_the_known_ones(cli, tmp_path):
    code, _, err = cli("demo", "fsdp3_magic", str(tmp_path))
    assert code == 2
    assert "fsdp3_magic" in err and "fsdp2_local_clip" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", ["step_1", "reference/step_1"])
def test_demo_refuses_to_overwrite_an_existing_dump_before_running_anything(cli, tmp_path, existing):
    folder = tmp_path / "fsdp2_correct" / existing
    folder.mkdir(parents=True)
    (folder / "rank_00000.safetensors").write_bytes(b"precious")
    code, out, err = cli("demo", "fsdp2_correct", str(tmp_path))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and str(folder) in err and "never overwrites" in err
    assert "running" not in err
    assert (folder / "rank_00000.safetensors").read_bytes() == b"precious"


def test_a_failing_demo_process_is_reported_with_its_traceback(tmp_path):
    # math.sqrt of a Path raises TypeError inside the child process.
    with pytest.raises(DemoRunFailed, match="demo process 0 of 1 failed: TypeError") as failed:
        run_single("math:sqrt", out_dir=Path(tmp_path), timeout_s=60)
    assert "\n" not in str(failed.value)
    assert "Traceback" in failed.value.detail and "_reference_process" in failed.value.detail


def fail_on_rank_one(ctx: RankContext) -> None:
    """Runs inside the spawned ranks of the test below (imported there by module name)."""
    import torch.distributed as dist

    if ctx.rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits here for a rank that never comes


def test_a_failing_rank_stops_the_others_at_once_instead_of_hanging(tmp_path):
    started = time.monotonic()
    with pytest.raises(DemoRunFailed, match="demo process 1 of 2 failed: ValueError: rank 1 gives up"):
        run_ranks(f"{__name__}:fail_on_rank_one", world_size=2, out_dir=Path(tmp_path), timeout_s=60)
    assert (
        time.monotonic() - started < 30
    )  # the collective timeout is 60 s: rank 0 was killed, not waited for
