"""The demo scenarios: one explicit table of stable names, what each runs, and what it should show."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

STEP = 1
"""The step number every demo dump carries."""


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One real training step with one real mistake (or none), run on CPU ranks joined by gloo."""

    name: str
    """Stable id: the CLI argument, the folder name under sample_dumps/, and the module under
    gradaudit.demo.scenarios that defines train_rank(ctx) and train_reference(out_dir)."""
    world_size: int
    """Ranks the scenario runs on."""
    stack: str
    """The training stack, in a few words."""
    mistake: str
    """What the step does wrong, in a few words ("none" for the correct one)."""
    expected: str
    """The error findings `gradaudit check` gives on this step, as documentation for `gradaudit demo --list`
    (tests/checks/test_samples_findings.py pins the exact codes)."""


# The table is laid out by hand (the formatter would put each field on a line of its own).
# fmt: off
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(name="fsdp2_correct", world_size=2,
        stack="FSDP2 fully_shard, 1-D mesh",
        mistake="none: clip_grad_norm_ on the DTensor gradients",
        expected="no error finding"),
    Scenario(name="fsdp2_local_clip", world_size=4,
        stack="FSDP2 fully_shard, 1-D mesh",
        mistake="clips by the norm of each rank's to_local() shards",
        expected="GA201 local norm, GA302 coefficient, GA303 post-clip norm; --reference: GA603"),
    Scenario(name="hsdp_world_allreduce", world_size=4,
        stack="HSDP, 2x2 (replicate, shard) mesh",
        mistake="hand-rolled norm all-reduced over the whole world",
        expected="GA202 replicas counted twice, GA302 coefficient; --reference: GA603"),
    Scenario(name="tp_layernorm_double_count", world_size=2,
        stack="tensor parallel (colwise, rowwise) + replicated LayerNorm",
        mistake="LayerNorm and bias gradients counted on every rank",
        expected="GA202 replicas counted twice, GA302 coefficient; --reference: GA603"),
    Scenario(name="pipeline_stage_norm", world_size=4,
        stack="2 pipeline stages x FSDP2 over 2 ranks, tied embedding",
        mistake="each stage clips by its own stage norm",
        expected="GA203 wrong group (dp), GA301 stages disagree, GA302, GA303; --reference: GA603"),
    Scenario(name="nonfinite_shard", world_size=2,
        stack="FSDP2 fully_shard, 1-D mesh",
        mistake="rank 1's fc1.weight shard holds an inf and a nan",
        expected="GA401 nonfinite values on rank 1; --reference: GA602, GA603"),
    Scenario(name="clip_before_unscale", world_size=2,
        stack="DDP + GradScaler",
        mistake="clips before scaler.unscale_",
        expected="GA502 clipped scaled gradients, GA302 coefficient; --reference: GA603"),
    Scenario(name="clip_per_microbatch", world_size=2,
        stack="DDP, 2 microbatches of gradient accumulation (no_sync() on the first)",
        mistake="clips after every microbatch",
        expected="GA501 clipped twice; --reference: GA602, GA603"),
    Scenario(name="ddp_drifted_replicas", world_size=2,
        stack="DDP, 2 microbatches of gradient accumulation",
        mistake="no_sync() around every microbatch: gradients never all-reduced",
        expected="GA601 replicas differ, GA301 coefficients differ; --reference: GA602, GA603"),
)
# fmt: on


def scenario_names() -> tuple[str, ...]:
    return tuple(s.name for s in SCENARIOS)


def get_scenario(name: str) -> Scenario:
    for scenario in SCENARIOS:
        if scenario.name == name:
            return scenario
    raise UsageError(f"no demo scenario named {name!r}; choose one of: {', '.join(scenario_names())}")


def scenario_table() -> str:
    """The scenarios as plain text, one per line: name, ranks, stack, mistake, expected findings."""
    width = max(len(s.name) for s in SCENARIOS)
    lines = []
    for s in SCENARIOS:
        lines.append(f"{s.name:<{width}}  {s.world_size} ranks  {s.stack}")
        lines.append(f"{'':<{width}}  mistake: {s.mistake}")
        lines.append(f"{'':<{width}}  expect:  {s.expected}")
    return "\n".join(lines)
