"""What to change: the fix line of each finding, read from its explanation, for the stack the dump shows.

An explanation's "How to fix it" text may hold sentences for one stack each ("With FSDP1, ..."). When
the dump tells the stack, a finding's fix line is that stack's sentence; otherwise the whole text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from ..model import StepFacts
from ..report.model import Finding, Severity
from .registry import BY_CODE

STACKS = ("FSDP2", "DTensor", "FSDP1", "DeepSpeed", "Megatron-style", "DDP")
"""The stacks a fix sentence can be written for, as they are spelled after "With"."""

CAPTURE_STACKS = {"DeepSpeedAudit": "DeepSpeed"}
"""Capture APIs that tell the stack by themselves (a ZeRO partition is a flat range, like FSDP1's)."""

GROUP_PIECE_APIS = frozenset({"guard"})
"""Capture APIs whose pieces are ownership groups laid out as flat ranges (the guard's dump of a wrong
step), not the stack's own pieces: their flat ranges say nothing of FSDP1."""

CAUSE_FIXES = {
    "GA304": {
        "listed_twice": "List each parameter once",
        "left_out": "Give the clip call every parameter",
        "per_call": "Clip once per step",
    },
    "GA210": {"listed_twice": "List each parameter once", "per_call": "Clip once per step"},
}
"""Codes whose fix depends on the cause in a finding's evidence: the explanation's fix sentence that
begins so (the whole fix when the cause is not recognised)."""

_SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z])")
_TENSOR_PARALLEL_AXES = frozenset({"tp", "tensor_model_parallel"})


def stack_of(step: StepFacts) -> str | None:
    """The training stack the dump shows (one of STACKS), or None when it does not tell.

    Read from the first present rank: every rank of a step runs the same stack."""
    if not step.ranks_present:
        return None
    rank = step.ranks[step.ranks_present[0]]
    by_api = CAPTURE_STACKS.get(rank.capture_api or "")
    if by_api is not None:
        return by_api
    topology = rank.topology
    if rank.capture_api not in GROUP_PIECE_APIS and rank.holds_flat_range:
        return "FSDP1"
    if topology.mesh is not None:
        return "DTensor" if set(topology.mesh.axis_names) <= _TENSOR_PARALLEL_AXES else "FSDP2"
    if _TENSOR_PARALLEL_AXES & set(topology.groups):
        return "Megatron-style"
    if rank.all_replicated:
        return "DDP"
    return None


def fix_for(fix_text: str, stack: str | None) -> str:
    """The sentence of `fix_text` written for `stack`, or the whole text when none is (or no stack)."""
    if stack is None:
        return fix_text
    for sentence in _SENTENCE_END.split(fix_text):
        head = sentence.split(",", 1)[0]
        if head.startswith("With ") and stack in re.findall(r"[\w-]+", head):
            return sentence
    return fix_text


def with_fixes(findings: Iterable[Finding], stack: str | None) -> tuple[Finding, ...]:
    """The findings, errors and warnings given the fix line of their code's explanation."""
    fixed = []
    for finding in findings:
        spec = BY_CODE.get(finding.code)
        if spec is not None and finding.severity is not Severity.INFO:
            fix = fix_for(spec.fix, stack)
            lead = CAUSE_FIXES.get(finding.code, {}).get(str(finding.evidence.get("cause")))
            if lead is not None:
                fix = next((s for s in _SENTENCE_END.split(spec.fix) if s.startswith(lead)), fix)
            finding = dataclasses.replace(finding, fix=fix)
        fixed.append(finding)
    return tuple(fixed)
