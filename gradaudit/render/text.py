"""Making untrusted text (parameter names, paths) safe to print or paste."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Replace control characters (ANSI escapes, newlines, tabs) by visible escapes."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\n", "\\n").replace("\t", "\\t"))


def rich_safe(text: str) -> str:
    """Printable, with rich markup escaped so `[red]` in a name is shown, not interpreted."""
    from rich.markup import escape

    return escape(printable(text))
