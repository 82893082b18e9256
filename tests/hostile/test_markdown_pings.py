"""A report pasted into a GitHub issue pings nobody: no mention, issue link, bare link or emoji comes out of a
parameter name, and every escape is unambiguous (a literal `\\x1b` and a real ESC byte print differently)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from gradaudit.render import json as json_render
from gradaudit.render import markdown as markdown_render
from gradaudit.render import terminal as terminal_render
from gradaudit.render.text import markdown_escape, printable
from gradaudit.report.model import (
    Environment,
    Finding,
    MultiStepReport,
    NotChecked,
    ParamComparison,
    RankRow,
    Report,
    Severity,
    StepSummary,
    TopologySummary,
)

from .cli import run_cli
from .corpus import write_valid_step

PINGING = (
    "@octocat",
    "cc @github/security-team",
    "https://evil.example/phish",
    "http://evil.example",
    "www.evil.example",
    ":tada: :+1: :thumbs_up:",
    "fixes #1",
    "GH-12",
    "someone@example.com",
)

GITHUB_ACTS_ON = {
    "mention": re.compile(r"(?<![\w`])@[A-Za-z0-9]"),
    "issue link": re.compile(r"(?<![\w&])#\d|\bGH-\d", re.IGNORECASE),
    "bare link": re.compile(r"https?://|\bwww\.", re.IGNORECASE),
    "emoji": re.compile(r":[a-z0-9_+-]+:", re.IGNORECASE),
}
"""What GitHub turns into a notification, a link or an emoji in a text node (after Markdown escapes)."""

OUR_HTML = {"<details>", "</details>", "</summary>", "<sub>", "</sub>"}


def report_with(names: tuple[str, ...]) -> Report:
    joined = " ".join(names)
    return Report(
        step=3,
        world_size=2,
        ranks_present=(0, 1),
        missing_ranks=(),
        norm_type=2.0,
        max_norm=1.0,
        global_norm=2.0,
        expected_clip_coef=0.5,
        ranks=tuple(
            RankRow(
                rank=r,
                local_norm=1.0,
                reported_norm=1.0,
                applied_clip_coef=1.0,
                applied_coef_source=names[0],
                diagnosis=f"wrong_group:{names[-1]}",
                diagnosis_detail=joined,
            )
            for r in range(2)
        ),
        findings=(
            Finding(
                code="GA204",
                severity=Severity.ERROR,
                title=joined,
                message=f"message {joined}",
                ranks=(0, 1),
                params=names,
                evidence={name: name for name in names},
            ),
        ),
        not_checked=(NotChecked(code="GA502", title=names[1], reason=joined),),
        verdict=f"verdict {joined}",
        environment=Environment(
            auditor_version=names[0],
            torch_versions=names,
            hosts=names,
            modes=names,
            world_size=2,
            run_ids=names,
        ),
        topology=TopologySummary(groups=dict.fromkeys(names, ((0, 1),)), norm_group=names[2]),
        reference=tuple(
            ParamComparison(
                param=name,
                kind=name,
                max_abs_error=1.0,
                max_rel_error=1.0,
                atol=0.0,
                rtol=0.0,
                within_tolerance=False,
            )
            for name in names
        ),
        command="gradaudit check ./step_3",
        warnings=names,
    )


def rendered_text_nodes(markdown: str) -> list[str]:
    """The text GitHub's filters see: Markdown parsed, escapes applied, entities decoded; code excluded."""
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    texts: list[str] = []
    for token in tokens:
        if token.type == "html_block":
            texts.extend(_html_text(token.content))
        for child in token.children or ():
            if child.type == "text":
                texts.append(child.content)
            elif child.type == "html_inline":
                assert child.content in OUR_HTML, child.content
    return texts


def _html_text(block: str) -> list[str]:
    import html

    for tag in OUR_HTML | {"<summary>"}:
        block = block.replace(tag, "\n")
    assert "<" not in block, block
    return [html.unescape(block)]


def test_names_that_would_mention_link_or_render_emoji_do_nothing_in_a_markdown_report() -> None:
    report = report_with(PINGING)
    summary = StepSummary(
        step=3,
        directory=" ".join(PINGING),
        global_norm=2.0,
        reported_norm=1.0,
        expected_clip_coef=0.5,
        num_errors=1,
        num_warnings=0,
        codes=PINGING,
    )
    multi = MultiStepReport(directory=" ".join(PINGING), steps=(report,), summary=(summary,))
    for markdown in (markdown_render.render_report(report), markdown_render.render_multi(multi)):
        texts = rendered_text_nodes(markdown)
        for kind, pattern in GITHUB_ACTS_ON.items():
            hits = [text for text in texts if pattern.search(text)]
            assert hits == [], f"GitHub would make a {kind} of {hits[:3]}"
        tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
        assert not any(c.type == "link_open" for t in tokens for c in t.children or ())


def test_the_defused_names_still_read_as_themselves() -> None:
    texts = "\n".join(rendered_text_nodes(markdown_render.render_report(report_with(PINGING))))
    for name in PINGING:
        assert name in texts.replace("\u200b", ""), name


def test_a_real_dump_with_a_hostile_run_id_gives_a_defused_markdown_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostile_run_id = "run by @octocat, see https://evil.example and #3 :tada:"
    step_dir = write_valid_step(tmp_path / "step_7", run_id=hostile_run_id)
    outcome = run_cli(capsys, "check", str(step_dir), "--format", "markdown")
    assert outcome.code == 0, outcome.stderr
    assert (
        "run by @&#8203;octocat, see https:&#8203;//evil.example and \\#&#8203;3 :&#8203;tada:"
        in outcome.stdout
    )
    for kind, pattern in GITHUB_ACTS_ON.items():
        hits = [text for text in rendered_text_nodes(outcome.stdout) if pattern.search(text)]
        assert hits == [], f"GitHub would make a {kind} of {hits[:3]}"


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("a\\x1bb", "a\x1bb"),
        ("a\\nb", "a\nb"),
        ("a\\tb", "a\tb"),
        ("a\\u200bb", "a\u200bb"),
        ("a\\\\x1bb", "a\\x1bb"),
        ("@\u200boctocat", "@octocat"),
        ("a&#8203;b", "a\u200bb"),
    ],
    ids=["esc", "newline", "tab", "zero-width space", "backslashes", "our zero-width space", "entity"],
)
def test_two_different_names_never_print_the_same_in_any_format(first: str, second: str) -> None:
    assert printable(first) != printable(second)
    assert markdown_escape(first) != markdown_escape(second)
    reports = [report_with((name, "x", "y")) for name in (first, second)]
    for render in (markdown_render.render_report, terminal_render.render_report, json_render.render_report):
        assert render(reports[0]) != render(reports[1])
    shown = ["\n".join(rendered_text_nodes(markdown_escape(name))) for name in (first, second)]
    assert shown[0] != shown[1]


def test_a_literal_backslash_escape_and_the_control_character_are_told_apart_on_screen() -> None:
    assert printable("\x1b[31m") == "\\x1b[31m"
    assert printable("\\x1b[31m") == "\\\\x1b[31m"
    assert rendered_text_nodes(markdown_escape("\x1b")) == ["\\x1b"]
    assert rendered_text_nodes(markdown_escape("\\x1b")) == ["\\\\x1b"]
    data = json.loads(json_render.render_report(report_with(("\x1b", "\\x1b", "z"))))
    assert data["findings"][0]["params"] == ["\x1b", "\\x1b", "z"]
