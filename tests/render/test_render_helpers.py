"""The shared pieces of the renderers: number formats and escaping of untrusted text."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gradaudit.norms import norm_name
from gradaudit.render.numbers import (
    fmt_coef,
    fmt_float,
    fmt_nonfinite,
    fmt_percent,
    fmt_ranks,
    json_number,
    reference_worst_first,
)
from gradaudit.render.text import join_limited, markdown_code_block, markdown_escape, printable, rich_safe
from gradaudit.report.model import NonfiniteCounts, ParamComparison


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (1.6, "1.6"),
        (1.0, "1"),
        (0.0, "0"),
        (-0.0, "0"),
        (1 / 3, "0.333333"),
        (1e20, "1e+20"),
        (123456789.0, "1.23457e+08"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (3, "3"),
    ],
)
def test_floats_show_six_significant_digits_and_spell_out_nonfinite_values(value, text):
    assert fmt_float(value) == text


def test_a_coefficient_below_one_is_never_shown_as_one():
    assert fmt_coef(1.0) == "1"
    assert fmt_coef(0.9999996) == "0.9999996"
    assert fmt_coef(0.625) == "0.625" and fmt_coef(None) == "-" and fmt_coef(math.nan) == "nan"


def test_norm_names_and_percentages():
    assert norm_name(2.0) == "L2 norm" and norm_name(math.inf) == "Linf norm" and norm_name(None) == "norm"
    assert fmt_percent(0.25) == "25.0%" and fmt_percent(math.nan) == "nan" and fmt_percent(None) == "-"


def test_rank_lists_collapse_consecutive_runs():
    assert fmt_ranks((3, 0, 1, 2, 7, 9, 10)) == "0-3, 7, 9-10"
    assert fmt_ranks(()) == "-" and fmt_ranks((5,)) == "5" and fmt_ranks((1, 1, 2)) == "1-2"


def test_nonfinite_counts_show_only_what_is_there():
    assert fmt_nonfinite(NonfiniteCounts()) == "0"
    assert fmt_nonfinite(NonfiniteCounts(nan=2, neginf=1)) == "2 nan, 1 -inf"


def test_json_numbers_are_plain_and_nonfinite_ones_are_strings():
    values = [json_number(v) for v in (1.5, math.nan, math.inf, -math.inf, None, 3, True, "x")]
    assert values == [1.5, "nan", "inf", "-inf", None, 3, True, "x"]
    assert json_number(np.float32(0.5)) == 0.5 and type(json_number(np.float64(0.5))) is float
    assert json_number(np.int64(7)) == 7 and type(json_number(np.int64(7))) is int
    assert json_number(np.float32("nan")) == "nan"
    json.dumps([json_number(v) for v in (math.nan, np.float64("inf"))], allow_nan=False)
    with pytest.raises(TypeError, match="cannot put list"):
        json_number([1.0])


def test_reference_comparisons_put_failures_and_larger_errors_first():
    def comparison(name, rel, ok):
        return ParamComparison(
            param=name,
            kind="grad",
            max_abs_error=rel,
            max_rel_error=rel,
            atol=0.0,
            rtol=0.0,
            within_tolerance=ok,
        )

    ordered = reference_worst_first(
        [
            comparison("a", 0.1, True),
            comparison("b", 0.2, False),
            comparison("c", math.nan, False),
            comparison("d", 0.9, True),
        ]
    )
    assert [c.param for c in ordered] == ["c", "b", "d", "a"]


def test_printable_makes_control_and_invisible_characters_visible_and_keeps_other_unicode():
    assert printable("a\nb\tc\x1b[31m\x7f") == "a\\nb\\tc\\x1b[31m\\x7f"
    assert printable("\u202eabc\u200b\u2028") == "\\u202eabc\\u200b\\u2028"
    assert printable("权重.é.λ") == "权重.é.λ"
    assert printable("lone \ud800 surrogate") == "lone \\ud800 surrogate"
    printable("lone \ud800").encode("utf-8")


def test_rich_safe_escapes_markup():
    assert rich_safe("[red]x[/red]\n") == "\\[red]x\\[/red]\\n"


@pytest.mark.parametrize(
    ("name", "escaped"),
    [
        ("a|b", "a\\|b"),
        ("`x`", "\\`x\\`"),
        ("<b>&amp;", "\\<b\\>\\&amp;"),
        ("*a* _b_ ~~c~~ $d$", "\\*a\\* \\_b\\_ \\~\\~c\\~\\~ \\$d\\$"),
        ("[link](http://x)", "\\[link\\](http:&#8203;//x)"),
        ("# h", "\\# h"),
        ("- item", "\\- item"),
        ("+ item", "\\+ item"),
        ("12. item", "12\\. item"),
        ("3) item", "3\\) item"),
        ("---", "\\---"),
        ("back\\slash", "back\\\\\\\\slash"),
        ("line\nbreak", "line\\\\nbreak"),
        ("model.layers.0.weight", "model.layers.0.weight"),
        ("0.1.0", "0.1.0"),
        ("权重", "权重"),
    ],
)
def test_markdown_escape_neutralises_markdown_syntax(name, escaped):
    assert markdown_escape(name) == escaped


def test_code_block_fence_is_longer_than_any_backtick_run_inside():
    assert markdown_code_block("echo hi") == "```\necho hi\n```\n"
    assert markdown_code_block("a ```` b\nc", info="sh") == "`````sh\na ```` b\\nc\n`````\n"


def test_join_limited_counts_what_it_leaves_out():
    assert join_limited(["a", "b", "c"], limit=2, escape=str.upper) == "A, B (+1 more)"
    assert join_limited([], limit=2, escape=str) == "-"
    assert join_limited(["a"], limit=2, escape=str) == "a"


def test_small_shares_keep_two_significant_digits_so_a_large_world_does_not_read_all_zero() -> None:
    from gradaudit.render.numbers import fmt_percent

    assert [fmt_percent(x) for x in (0.25, 1 / 4096, 0.0, None)] == ["25.0%", "0.024%", "0.0%", "-"]


def test_an_inf_norm_step_names_its_norm_the_same_in_the_verdict_and_the_headline(tmp_path):
    """The verdict said "inf-norm" while the headline said "Linf norm": one norm_name now."""
    import torch
    from builders import check, clip, sharded_rows

    from gradaudit.render.terminal import render_report

    grads = [torch.tensor([[0.5, -0.25]]), torch.tensor([[0.75, 0.1]])]
    step = sharded_rows(
        tmp_path, grads, clips=clip(norm_type=math.inf, reported_norm=0.75), norm_type=math.inf
    )
    report = check(step)
    assert report.verdict.startswith("True global Linf norm 0.75"), report.verdict
    assert "inf-norm" not in render_report(report, width=120)
    assert "true global Linf norm 0.75" in render_report(report, width=120)


def test_run_table_notes_name_each_step_clipped_several_times_once_per_number_of_calls():
    from gradaudit.render.steps import StepRow, first_call_notes

    def row(step: int, calls: int) -> StepRow:
        span = (1.0, 1.0)
        return StepRow(
            steps=(step,),
            reported_norm=span,
            global_norm=span,
            ratio=span,
            expected_clip_coef=span,
            num_errors=1,
            num_warnings=0,
            codes=("GA501",),
            failing=True,
            clip_calls=calls,
        )

    notes = first_call_notes([row(1, 3), row(2, 1), row(5, 3), row(7, 2)])
    assert notes == [
        "steps 1, 5: reported norm, true norm and expected coef at the first of their 3 clip calls"
        "; their own reports give the true norm before the last",
        "step 7: reported norm, true norm and expected coef at the first of its 2 clip calls"
        "; its own report gives the true norm before the last",
    ]
