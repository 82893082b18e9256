"""The one table of finding codes: one row per code, and every per-code list is read from it."""

from __future__ import annotations

from gradaudit.checks.registry import (
    BY_CODE,
    CAUSES_FIRST,
    CHECKS,
    CLIPPING_CODES,
    explain,
)


def test_each_code_has_one_row_in_code_order_with_a_distinct_verdict_rank() -> None:
    codes = [spec.code for spec in CHECKS]
    assert codes == sorted(set(codes))
    assert all(code.startswith("GA") and len(code) == 5 and code[2:].isdigit() for code in codes)
    assert len({spec.verdict_rank for spec in CHECKS}) == len(CHECKS)
    assert set(BY_CODE) == set(codes)


def test_the_verdict_order_names_every_code_and_puts_causes_before_their_consequences() -> None:
    assert sorted(CAUSES_FIRST) == sorted(BY_CODE)  # GA104 was missing from the hand-kept list
    position = {code: i for i, code in enumerate(CAUSES_FIRST)}
    for cause, consequence in (
        ("GA601", "GA301"),  # a drifted replica makes the coefficients differ
        ("GA502", "GA302"),  # clipping on scaled gradients gives a wrong coefficient
        ("GA103", "GA204"),  # a gap in ownership makes the norm match no known mistake
        ("GA104", "GA204"),  # so does a parameter the capture left out
        ("GA201", "GA602"),  # a local norm makes the gradients differ from the reference
    ):
        assert position[cause] < position[consequence]


def test_the_clipping_codes_and_the_codes_decided_with_ranks_missing_are_flags_of_their_rows() -> None:
    assert tuple(s.code for s in CHECKS if s.decides_clipping) == CLIPPING_CODES
    assert {"GA201", "GA302"} <= set(CLIPPING_CODES)
    assert BY_CODE["GA100"].decided_with_ranks_missing and not BY_CODE["GA201"].decided_with_ranks_missing


def test_explain_prints_every_row_with_its_four_sections() -> None:
    for spec in CHECKS:
        text = explain(spec.code.lower())
        assert text.startswith(f"{spec.code} ({spec.severity.value}): {spec.title}\n")
        for heading in ("What it checks", "Why it matters", "Example", "How to fix it"):
            assert f"\n{heading}\n" in text
