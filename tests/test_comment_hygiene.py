"""Comments and docstrings in gradaudit/ state facts, not the internal tracker numbers they came from.

"issue 17", "Issue #12", "(#23)", "PR #4", "turn-3" mean nothing to a reader of the package; the fact
they stood for is what belongs there. A public upstream issue keeps its number in the owner/repo#N
form (pytorch/pytorch#12345) or as its URL.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gradaudit"

INTERNAL_NUMBER = re.compile(
    r"\bissues? ?#?\d+"  # issue 17, Issue #12, issues 3
    r"|\b(?:PR|pull request) ?#?\d+"  # PR 4, PR #4, pull request 9
    r"|\bturn[- ]?\d+\b"  # turn-3, turn 3
    r"|\bGH-\d+"  # GH-12
    r"|(?<![\w/.&-])#\d+\b",  # #12, (#23); not owner/repo#12 nor &#8203;
    re.IGNORECASE,
)


def comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and of every string-only statement (docstrings of modules,
    classes, functions and attributes)."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node.lineno, node.value.value


def internal_numbers(source: str) -> list[tuple[int, str]]:
    """(line, what matched) for each internal tracker number in the comments and docstrings of `source`."""
    return sorted(
        (line, m.group(0))
        for line, text in comments_and_docstrings(source)
        for m in INTERNAL_NUMBER.finditer(text)
    )


def test_no_comment_or_docstring_in_the_package_cites_an_internal_tracker_number() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {match!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, match in internal_numbers(path.read_text(encoding="utf-8"))
    ]
    assert found == [], (
        "say the fact, not the internal issue it came from (a public upstream issue is written "
        "owner/repo#N):\n" + "\n".join(found)
    )


def test_the_scan_finds_tracker_numbers_in_comments_and_docstrings_and_spares_public_ones() -> None:
    source = '''"""Module (issue 17 item 2)."""

class A:
    """Fixed in (#23)."""

    x: int = 1
    """As turn-3 decided."""

    def f(self) -> str:
        # Issue #12: why
        # pytorch/pytorch#12345 and deepspeedai/DeepSpeed#8588 are public
        # https://github.com/pytorch/pytorch/issues/12345 too; so is a GA204 code, or &#8203;
        return "issue 5 in a string that is code is not a comment"  # see PR #4
'''
    assert internal_numbers(source) == [
        (1, "issue 17"),
        (4, "#23"),
        (7, "turn-3"),
        (10, "Issue #12"),
        (13, "PR #4"),
    ]
