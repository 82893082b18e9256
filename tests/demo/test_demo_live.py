"""`gradaudit demo` end to end on real gloo ranks: two scenarios run live, then checked like the
committed samples (the others are proven by their committed dumps)."""

from __future__ import annotations

import pytest
from samples import check_json, codes, reference_dir, step_dir

pytestmark = pytest.mark.integration


def demo(cli, scenario: str, out_dir) -> str:
    code, out, err = cli("demo", scenario, out_dir)
    assert code == 0, err
    assert out == ""  # what it wrote and the next command are status lines, on stderr
    return err


@pytest.mark.parametrize("scenario", ["fsdp2_correct", "fsdp2_local_clip"])
def test_live_demo_reproduces_the_committed_sample(scenario, capsys, cli, tmp_path):
    err = demo(cli, scenario, tmp_path)
    live_step, live_reference = step_dir(scenario, tmp_path), reference_dir(scenario, tmp_path)
    assert f"next: gradaudit check {live_step} --reference {live_reference}" in err
    assert sorted(p.name for p in live_step.iterdir()) == sorted(p.name for p in step_dir(scenario).iterdir())
    assert [p.name for p in live_reference.iterdir()] == ["rank_00000.safetensors"]

    live = check_json(capsys, live_step, live_reference)
    sample = check_json(capsys, step_dir(scenario), reference_dir(scenario))
    assert codes(live) == codes(sample)
    assert live["global_norm"] == pytest.approx(sample["global_norm"], rel=1e-5)
    for live_row, sample_row in zip(live["ranks"], sample["ranks"], strict=False):
        assert live_row["reported_norm"] == pytest.approx(sample_row["reported_norm"], rel=1e-5)
        assert live_row["diagnosis"] == sample_row["diagnosis"]
