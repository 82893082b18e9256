"""Terminal rendering of `gradaudit show`."""

from __future__ import annotations

import io

from ..checks.base import count, ranks_named
from ..ranksets import compact_ranks
from ..report.inventory import Inventory, RunInventory
from .terminal import make_console, print_guard_trend
from .text import rich_safe

MAX_LISTED = 20
"""Parameters not captured listed on the terminal; the JSON form lists every one."""


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def render_inventory(inv: Inventory, *, width: int = 100, color: bool = False) -> str:
    from rich.table import Table

    out = io.StringIO()
    console = make_console(out, width, color)
    missing = compact_ranks(inv.missing_ranks) or "none"
    console.print(f"[bold]Step {inv.step}[/bold]  {rich_safe(inv.directory)}")
    console.print(
        f"world size {inv.world_size}; ranks present {len(inv.ranks_present)}; missing {missing}; "
        f"mode {'/'.join(inv.modes)}; {_human_bytes(inv.total_bytes)} on disk"
    )
    if inv.mesh:
        console.print(f"mesh: {rich_safe(inv.mesh)}")
    for name, ranks in inv.groups:
        console.print(f"group {rich_safe(name)}: {ranks}")
    if inv.norm_group:
        console.print(f"norm reduced over: {rich_safe(inv.norm_group)}")
    table = Table(show_lines=False)
    for column in ("parameter", "global shape", "dtype", "layout", "held by"):
        table.add_column(column)
    unheld = [p.name for p in inv.params if not p.holders]
    fold = len(unheld) > MAX_LISTED  # a table may list 10^6 parameters of which the ranks hold 4
    for p in inv.params:
        if fold and not p.holders:
            continue
        holders = "; ".join(f"r{r} {rich_safe(h)}" for r, h in p.holders) or "nobody"
        table.add_row(
            rich_safe(p.name),
            "x".join(map(str, p.global_shape)) or "scalar",
            p.dtype,
            rich_safe(p.layout),
            holders,
        )
    if fold:
        names = ", ".join(rich_safe(name) for name in unheld[:3])
        table.add_row(f"({len(unheld)} parameters: {names}, …)", "", "", "", "nobody")
    console.print(table)
    if fold:
        console.print(
            f"{len(unheld)} parameters held by nobody are folded into one row; --format json lists them all"
        )
    if inv.not_captured:
        console.print(f"not captured ({len(inv.not_captured)}; their gradients are in no norm, GA104):")
        for left_out in inv.not_captured[:MAX_LISTED]:
            where = ranks_named(left_out.ranks)
            console.print(f"  {rich_safe(left_out.name)} on {where}: {rich_safe(left_out.reason)}")
        if len(inv.not_captured) > MAX_LISTED:
            console.print(f"  (and {len(inv.not_captured) - MAX_LISTED} more; --format json lists them all)")
    for warning in inv.warnings:
        console.print(f"warning: {rich_safe(warning)}")
    return out.getvalue()


def render_run_inventory(run: RunInventory, *, width: int = 100, color: bool = False) -> str:
    """A run folder: how many step folders, a guarded run's trend (failing steps first), then each step."""
    out = io.StringIO()
    console = make_console(out, width, color)
    console.print(
        f"[bold]Run folder[/bold]  {rich_safe(run.directory)}: {count(len(run.steps), 'step folder')}"
    )
    if run.guard_trend is not None:
        print_guard_trend(console, run.guard_trend, chart=False)
    return "\n".join(
        [out.getvalue(), *(render_inventory(inv, width=width, color=color) for inv in run.steps)]
    )
