"""Folding per-rank sentences: ranks whose explanations differ only in their numbers share one sentence.

"reported norm 0.48 matches rank 0's own pieces only (0.48)" and the same sentence of rank 1 become
"reported norm 0.48–0.56 matches each rank's own pieces only (0.48–0.56)" for ranks 0-1: numbers that
differ are shown as ranges, a rank's mention of itself as "each rank", rank lists that differ one after
the other. Shared by the check messages and the renderers, so a report says each explanation once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

_SLOT = re.compile(
    r"(?P<self>\brank (?P<rank>\d+)(?P<own>'s)?(?![\w.]))"
    r"|(?P<list>\[[^\]]*\])"
    r"|(?P<number>(?<![\w.])-?(?:\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf)(?![\w.]|\.\d))"
)
MAX_LISTS_SHOWN = 3


@dataclass(frozen=True, kw_only=True)
class FoldedSentence:
    ranks: tuple[int, ...]
    """The ranks whose sentences it folds, in order of first appearance."""
    text: str
    """The sentence, with the numbers that differ shown as ranges."""


def _parts(rank: int, sentence: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(the sentence's fixed text around its slots, each slot as (kind, text))."""
    fixed: list[str] = []
    slots: list[tuple[str, str]] = []
    start = 0
    for m in _SLOT.finditer(sentence):
        if m.group("self") and int(m.group("rank")) != rank:
            continue  # another rank named: part of the fixed text
        kind = "own" if m.group("own") else str(m.lastgroup)  # the outer group closes last: "self"
        fixed.append(sentence[start : m.start()])
        slots.append((kind, m.group()))
        start = m.end()
    fixed.append(sentence[start:])
    return tuple(fixed), tuple(slots)


def fold_sentences(items: Sequence[tuple[int, str]]) -> list[FoldedSentence]:
    """One sentence per explanation shared by several ranks, in order of each one's first rank."""
    groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[tuple[int, tuple[str, ...]]]] = {}
    for rank, sentence in items:
        fixed, slots = _parts(rank, sentence)
        key = (fixed, tuple(kind for kind, _ in slots))
        groups.setdefault(key, []).append((rank, tuple(text for _, text in slots)))
    folded = []
    for (fixed, kinds), members in groups.items():
        ranks = tuple(rank for rank, _ in members)
        if len(members) == 1:
            values = list(members[0][1])
        else:
            values = [_merge(kind, [texts[i] for _, texts in members]) for i, kind in enumerate(kinds)]
        text = fixed[0] + "".join(value + after for value, after in zip(values, fixed[1:], strict=True))
        folded.append(FoldedSentence(ranks=ranks, text=text))
    return sorted(folded, key=lambda f: min(f.ranks))


def _merge(kind: str, texts: list[str]) -> str:
    if kind == "self":
        return "each rank"
    if kind == "own":
        return "each rank's"
    distinct = list(dict.fromkeys(texts))
    if len(distinct) == 1:
        return distinct[0]
    if kind == "list":
        shown = " or ".join(distinct[:MAX_LISTS_SHOWN])
        return shown if len(distinct) <= MAX_LISTS_SHOWN else f"{shown} (one per rank)"
    numbers = [float(t) for t in distinct]
    if any(math.isnan(n) for n in numbers):
        return " or ".join(distinct[:MAX_LISTS_SHOWN]) + (" …" if len(distinct) > MAX_LISTS_SHOWN else "")
    low = distinct[min(range(len(numbers)), key=numbers.__getitem__)]
    high = distinct[max(range(len(numbers)), key=numbers.__getitem__)]
    return f"{low}–{high}"
