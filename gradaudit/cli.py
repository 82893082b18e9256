"""The command line: parses arguments, calls the core, prints, and picks the exit code."""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import GradauditError

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Audit gradient clipping under sharded training from per-rank gradient dumps.",
)


class OutputFormat(str, enum.Enum):
    terminal = "terminal"
    markdown = "markdown"
    json = "json"


class ShowFormat(str, enum.Enum):
    terminal = "terminal"
    json = "json"


@app.callback()
def _root() -> None:
    """Audit gradient clipping under sharded training from per-rank gradient dumps."""


def _emit(text: str, output: Optional[Path]) -> None:
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    output.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")


@app.command()
def show(
    directory: Path = typer.Argument(..., help="A step_<N> folder of rank files."),
    format: ShowFormat = typer.Option(ShowFormat.terminal, "--format", "-f", help="terminal or json."),
) -> None:
    """List what a step folder holds: ranks, topology, parameters and who holds which part."""
    from .dumpfile import load_step
    from .inventory import build_inventory, inventory_to_json

    inventory = build_inventory(load_step(directory))
    if format is ShowFormat.json:
        _emit(json.dumps(inventory_to_json(inventory), indent=2, sort_keys=True), None)
    else:
        from .render.inventory import render_inventory

        _emit(render_inventory(inventory, width=_terminal_width(), color=sys.stdout.isatty()), None)


def _terminal_width() -> int:
    import shutil

    return max(80, min(160, shutil.get_terminal_size((100, 24)).columns))


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors exit 2 with one line; anything unexpected exits 3."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    try:
        app(args=args, prog_name="gradaudit", standalone_mode=False)
    except GradauditError as exc:
        _fail(f"error: {exc}", EXIT_BAD_INPUT, debug)
    except SystemExit as exc:
        raise
    except KeyboardInterrupt:
        _fail("interrupted", 130, debug)
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        if _is_usage_error(exc):
            exc.show()  # type: ignore[attr-defined]
            sys.exit(EXIT_BAD_INPUT)
        if type(exc).__name__ == "Abort":
            _fail("aborted", EXIT_BAD_INPUT, debug)
        _fail(
            f"internal error: {type(exc).__name__}: {exc}. This is a bug in gradaudit, not in your dump; "
            "re-run with --debug for the traceback and report it",
            EXIT_INTERNAL,
            debug,
        )
    sys.exit(EXIT_OK)


def _is_usage_error(exc: Exception) -> bool:
    """typer may bundle its own click; recognise its usage errors by their class family."""
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__) and hasattr(exc, "show")


def _fail(message: str, code: int, debug: bool) -> None:
    if debug:
        import traceback

        traceback.print_exc()
    from .render.text import printable

    sys.stderr.write(printable(message) + "\n")
    sys.exit(code)
