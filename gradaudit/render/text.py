"""Making untrusted text (parameter names, paths) safe to print or paste."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_INVISIBLE_CATEGORIES = ("Cf", "Zl", "Zp", "Cs")
"""Bidi overrides, zero-width characters and Unicode line/paragraph separators (they can reorder, hide
or break a line without being seen), and lone surrogates from JSON "\\ud800" escapes (they cannot be
encoded, so printing them would raise)."""

_MARKDOWN_SPECIAL = re.compile(r"[\\`*_\[\]<>#|~&$]")
"""Emphasis, code, links and images (a link needs its "["), HTML, entities, headings, cells, strike-through, math."""
_GITHUB_REFERENCE = re.compile(
    r"(?<=@)(?=[A-Za-z0-9])|(?<=#)(?=\d)|(?<=\bGH)(?=-\d)|(?<=:)(?=//)|(?<=\bwww)(?=\.)|(?<=:)(?=[A-Za-z0-9_+-]+:)",
    re.IGNORECASE,
)
"""Where GitHub would make a mention (@user), an issue link (# and digits), a bare link (https://, www.) or an emoji
(:tada:) out of plain text; it does so after Markdown escapes are applied, so backslashes cannot stop it."""
ZERO_WIDTH_SPACE = "&#8203;"
"""Written as an entity so that the Markdown source shows it; a zero-width space in a name itself is shown
by `printable` as `\\u200b`, so the two cannot be confused."""
_MARK = "\x00"
_MARKDOWN_BLOCK_START = re.compile(r"^(\s*)([-+=](?=[\s=-]|$)|\d{1,9}[.)](?=\s|$))")
"""A list item ("- x", "1. x"), a thematic break ("---") or a setext underline ("==="); "0.1.0" is none."""


def _escape_invisible(text: str) -> str:
    if text.isascii():
        return text
    return "".join(
        f"\\u{ord(ch):04x}" if unicodedata.category(ch) in _INVISIBLE_CATEGORIES else ch for ch in text
    )


def printable(text: str) -> str:
    """Replace control characters (ANSI escapes, newlines, tabs) and invisible Unicode by visible escapes.

    A backslash is doubled first, so the escapes are unambiguous: a real ESC byte prints as `\x1b`, the
    four characters `\x1b` as `\\x1b`.
    """
    text = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    return _escape_invisible(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


def rich_safe(text: str) -> str:
    """Printable, with rich markup escaped so `[red]` in a name is shown, not interpreted.

    For markup strings. rich doubles a trailing backslash so that a tag after it stays a tag; with no tag
    after it both backslashes show. Rendering untrusted text as `rich.text.Text(printable(name))` avoids
    markup altogether (the report renderer does that).
    """
    from rich.markup import escape

    return escape(printable(text))


def markdown_escape(text: str) -> str:
    """Printable, with Markdown syntax backslash-escaped: safe inside a table cell, a list item or a heading.

    Every character that could start emphasis, code, a link, HTML, an entity, math, a table cell or
    strike-through is escaped, and so is a leading marker that would start a block (list, rule, underline).
    Text GitHub would turn into a mention, an issue link, a bare link or an emoji gets a zero-width space
    where the pattern would match (`@&#8203;octocat`), so pasting a report into an issue pings nobody.
    """
    # The references are found before escaping ("thumbs\\_up" would hide ":thumbs_up:" from the pattern) and
    # marked with NUL, which `printable` has already removed from the text.
    marked = _GITHUB_REFERENCE.sub(_MARK, printable(text))
    escaped = _MARKDOWN_SPECIAL.sub(lambda m: "\\" + m.group(), marked)
    escaped = _MARKDOWN_BLOCK_START.sub(lambda m: m.group(1) + _escape_block_marker(m.group(2)), escaped)
    return escaped.replace(_MARK, ZERO_WIDTH_SPACE)


def _escape_block_marker(marker: str) -> str:
    # "12." becomes "12\." (the dot or parenthesis is what makes an ordered list); "-", "+", "=" get a backslash.
    if marker[0].isdigit():
        return marker[:-1] + "\\" + marker[-1]
    return "\\" + marker


def markdown_code_block(text: str, *, info: str = "") -> str:
    """A fenced code block holding `text` verbatim (control characters, newlines too, made visible)."""
    return _fenced(printable(text), info)


def markdown_text_block(lines: Sequence[str], *, info: str = "text") -> str:
    """A fenced code block holding `lines` one per line, each verbatim (control characters made visible)."""
    return _fenced("\n".join(printable(line) for line in lines), info)


def _fenced(body: str, info: str) -> str:
    """The fence is longer than any run of backticks in the body, so the body cannot close it."""
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{body}\n{fence}\n"


def clip_text(text: str, max_chars: int) -> str:
    """`text`, cut to `max_chars` characters with "…" at the end when longer (cut before escaping)."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - 1)] + "…"


def clip_sentences(text: str, max_chars: int, *, rest: str = "…") -> str:
    """`text` when it fits `max_chars`, else its leading clauses (cut after a "; " or ". ") and `rest`:
    never a cut in the middle of a sentence, a number or a name (cut before escaping)."""
    if len(text) <= max_chars:
        return text
    room = max(0, max_chars - len(rest) - 1)
    cut = max(text.rfind("; ", 0, room + 1), text.rfind(". ", 0, room + 1))
    if cut <= 0:
        return clip_text(text, max_chars)  # one clause longer than the limit: a plain cut is all there is
    return f"{text[: cut + 1]} {rest}"


def join_limited(names: Sequence[str], *, limit: int, escape: Callable[[str], str]) -> str:
    """The first `limit` names, escaped and joined, then "(+N more)"; "-" when there are none."""
    if not names:
        return "-"
    shown = ", ".join(escape(name) for name in names[:limit])
    hidden = len(names) - limit
    return f"{shown} (+{hidden} more)" if hidden > 0 else shown
