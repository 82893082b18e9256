"""The seed note's two fixtures, from real FSDP2 runs: every shard below max_norm while the whole
gradient is above it, and one rank's shard holding an inf and a nan. For both, the clipped gradients
and the next weights are compared with the unsharded reference, and the report says which differ and
by how much."""

from __future__ import annotations

import pytest
from safetensors import safe_open
from samples import REPO, check_json, codes, reference_dir, step_dir

from gradaudit.demo.toy import LEARNING_RATE

PARAMS = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


def reference_tensors(scenario: str, kind: str) -> dict:
    """The reference's tensors of `kind` by parameter, read straight from its one rank file."""
    path = reference_dir(scenario) / "rank_00000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        keys = f.keys()  # safe_open is not iterable
        return {key.split("::")[0]: f.get_tensor(key).double() for key in keys if key.split("::")[1] == kind}


def comparisons(report: dict, kind: str) -> dict:
    return {c["param"]: c for c in report["reference"] if c["kind"] == kind}


def test_every_shard_is_below_max_norm_but_the_whole_gradient_is_above_it(capsys):
    report = check_json(capsys, step_dir("fsdp2_local_clip"))
    assert len(report["ranks"]) == 4
    assert all(row["local_norm"] < report["max_norm"] for row in report["ranks"])
    assert report["global_norm"] > report["max_norm"]
    assert all(row["applied_clip_coef"] == pytest.approx(1.0) for row in report["ranks"])
    assert report["expected_clip_coef"] == pytest.approx(report["max_norm"] / (report["global_norm"] + 1e-6))
    assert sum(row["local_norm"] ** 2 for row in report["ranks"]) == pytest.approx(report["global_norm"] ** 2)


def test_local_clip_gradients_match_the_reference_but_clipped_gradients_and_next_weights_do_not(capsys):
    report = check_json(capsys, step_dir("fsdp2_local_clip"), reference_dir("fsdp2_local_clip"))
    assert all(c["within_tolerance"] for c in comparisons(report, "grad").values())
    shortfall = (
        1.0 - report["expected_clip_coef"]
    )  # the ranks applied 1, the reference the expected coefficient
    reference_grads = reference_tensors("fsdp2_local_clip", "grad")
    for kind, scale in (("grad_clipped", shortfall), ("param_after", LEARNING_RATE * shortfall)):
        differing = comparisons(report, kind)
        assert sorted(differing) == PARAMS
        for param, comparison in differing.items():
            assert not comparison["within_tolerance"]
            expected_error = scale * float(reference_grads[param].abs().max())
            assert comparison["max_abs_error"] == pytest.approx(expected_error, rel=1e-3), (kind, param)
    assert codes(report).count("GA603") == 2


def test_nonfinite_shard_is_named_with_its_rank_parameter_and_counts(capsys):
    report = check_json(capsys, step_dir("nonfinite_shard"))
    (finding,) = [f for f in report["findings"] if f["code"] == "GA401"]
    assert finding["ranks"] == [[1, 1]] and finding["params"] == ["fc1.weight"]
    assert "1 nan, 1 +inf" in finding["message"]
    rows = {row["rank"]: row["nonfinite"] for row in report["ranks"]}
    assert rows[0] == {"nan": 0, "posinf": 0, "neginf": 0}
    assert rows[1] == {"nan": 1, "posinf": 1, "neginf": 0}


def test_one_nonfinite_shard_spreads_to_every_clipped_gradient_and_next_weight(capsys):
    report = check_json(capsys, step_dir("nonfinite_shard"), reference_dir("nonfinite_shard"))
    grads = comparisons(report, "grad")
    assert [p for p, c in grads.items() if not c["within_tolerance"]] == ["fc1.weight"]
    for kind in ("grad_clipped", "param_after"):
        assert sorted(p for p, c in comparisons(report, kind).items() if not c["within_tolerance"]) == PARAMS
    messages = " ".join(f["message"] for f in report["findings"] if f["code"] == "GA603")
    assert all(param in messages for param in PARAMS)


def test_markdown_report_against_the_reference_names_the_differing_parameters_and_errors(
    capsys, cli, monkeypatch
):
    monkeypatch.chdir(REPO)
    _, markdown, _ = cli(
        "check",
        "sample_dumps/fsdp2_local_clip/step_1",
        "--reference",
        "sample_dumps/fsdp2_local_clip/reference/step_1",
        "--format",
        "markdown",
    )
    report = check_json(capsys, step_dir("fsdp2_local_clip"), reference_dir("fsdp2_local_clip"))
    worst = max(comparisons(report, "grad_clipped").values(), key=lambda c: c["max_abs_error"])
    assert "## Reference comparison" in markdown
    assert f"{worst['param']} (grad\\_clipped): max \\|error\\| {worst['max_abs_error']:.6g}" in markdown
