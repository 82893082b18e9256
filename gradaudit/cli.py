"""The command line: parses arguments, calls the core, prints, and picks the exit code."""

from __future__ import annotations

import contextlib
import enum
import importlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from .errors import GradauditError, UsageError

if TYPE_CHECKING:
    from .dumpfile.dump import StepDump
    from .report.inventory import Inventory
    from .report.model import MultiStepReport, Report

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3
STOPPED_BY: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}
"""The signals that stop a command cleanly: exit 128 + the signal's number (130, 143), one line on stderr."""

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: typer's rich help formatter alone takes as long as the rest of --help
    help="Audit gradient clipping under sharded training from per-rank gradient dumps.",
)


class OutputFormat(str, enum.Enum):
    terminal = "terminal"
    markdown = "markdown"
    json = "json"


class ShowFormat(str, enum.Enum):
    terminal = "terminal"
    json = "json"


class ColorChoice(str, enum.Enum):
    auto = "auto"
    always = "always"
    never = "never"


COLOR_HELP = (
    "auto (on a terminal, unless NO_COLOR is set; FORCE_COLOR=1 forces it, even piped), always or never. "
    "A report written with --output has colour only with always."
)


def _print_version(value: bool) -> None:
    if value:
        from .version import FORMAT_VERSION, __version__

        _emit(f"gradaudit {__version__} (dump format {FORMAT_VERSION})")
        raise SystemExit(EXIT_OK)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    """Audit gradient clipping under sharded training from per-rank gradient dumps."""


def _emit(text: str, output: Path | None = None) -> None:
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    from .reportfile import write_report_file

    write_report_file(output, text if text.endswith("\n") else text + "\n")


@app.command()
def show(
    directory: Path = typer.Argument(
        ..., help="A step_<N> folder of rank files, or a folder of step_<N> folders (a guarded run's too)."
    ),
    format: ShowFormat = typer.Option(ShowFormat.terminal, "--format", "-f", help="terminal or json."),
    color: ColorChoice = typer.Option(ColorChoice.auto, "--color", help=COLOR_HELP),
) -> None:
    """List what a step folder holds: ranks, topology, parameters and who holds which part.

    For a run folder, each of its steps, after a guarded run's trend (the steps the guard found wrong).
    """
    from .dumpfile import find_step_dirs, load_step
    from .live.trend import TREND_FILE
    from .report.inventory import RunInventory, inventory_to_json

    if find_step_dirs(directory) == [directory] and not (directory / TREND_FILE).is_file():
        inventory = _inventory(load_step(directory))
        if format is ShowFormat.json:
            import json

            _emit(json.dumps(inventory_to_json(inventory), indent=2, sort_keys=True))
        else:
            from .render.inventory import render_inventory

            _emit(render_inventory(inventory, width=_terminal_width(), color=_use_color(color)))
        return
    from .audit import read_guard_trend, run_step_dirs

    step_dirs = run_step_dirs(directory)
    run = RunInventory(
        directory=str(directory),
        guard_trend=read_guard_trend(directory, step_dirs),
        steps=tuple(_inventory(load_step(d)) for d in step_dirs),
    )
    if format is ShowFormat.json:
        from .render.json import render_run_inventory

        _emit(render_run_inventory(run))
    else:
        from .render.inventory import render_run_inventory as render_run_text

        _emit(render_run_text(run, width=_terminal_width(), color=_use_color(color)))


class FailOn(str, enum.Enum):
    error = "error"
    warning = "warning"
    never = "never"


@app.command()
def check(
    directory: Path = typer.Argument(
        ..., help="A step_<N> folder of rank files, or a folder of step_<N> folders."
    ),
    reference: Path | None = typer.Option(
        None, "--reference", help="An unsharded reference step (world size 1) of the same model and data."
    ),
    format: OutputFormat = typer.Option(
        OutputFormat.terminal, "--format", "-f", help="terminal, markdown or json."
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the report to this file."),
    fail_on: FailOn = typer.Option(
        FailOn.error, "--fail-on", help="Exit 1 on findings at or above: error, warning, never."
    ),
    rtol: float | None = typer.Option(None, "--rtol", help="Relative tolerance of the reference comparison."),
    atol: float | None = typer.Option(None, "--atol", help="Absolute tolerance of the reference comparison."),
    all_ranks: bool = typer.Option(
        False,
        "--all-ranks",
        help="One row per rank in terminal and Markdown reports, instead of folding ranks that agree.",
    ),
    allow_incomplete_ranks: bool = typer.Option(
        False,
        "--allow-incomplete-ranks",
        help="Audit the readable ranks; report each unreadable rank file as a missing rank with its reason.",
    ),
    failing_only: bool = typer.Option(
        False,
        "--failing-only",
        help="For a folder of steps: list only the steps with errors, warnings or missing ranks "
        "(terminal and Markdown; JSON keeps every step).",
    ),
    color: ColorChoice = typer.Option(ColorChoice.auto, "--color", help=COLOR_HELP),
) -> None:
    """Recompute the true global gradient norm of a step and audit how it was clipped.

    Exit codes: 0 nothing at or above --fail-on, 1 findings (or failing steps in the guard's trend),
    2 unusable input or usage, 3 internal error, 130 and 143 stopped by SIGINT (Ctrl-C) and SIGTERM.
    """
    from .audit import audit_folder
    from .checks.base import AuditOptions
    from .report.model import MultiStepReport

    if output is not None:
        from .reportfile import refuse_output_path

        refuse_output_path(output, [directory] + ([reference] if reference is not None else []))
    try:
        options = AuditOptions(
            reference=None if reference is None else str(reference),
            rtol=rtol,
            atol=atol,
            allow_incomplete_ranks=allow_incomplete_ranks,
        )
    except ValueError as exc:
        raise UsageError(f"{exc}; pass --rtol/--atol as non-negative numbers") from None
    from .progress import check_progress
    from .scaleout import launch_env, scaled_out

    env = launch_env()  # under torchrun: files and parameters split among the processes, rank 0 prints
    printing = env is None or env.rank == 0
    with (
        scaled_out(env) as shares,
        check_progress(enabled=printing and format is not OutputFormat.json) as progress,
    ):
        result = audit_folder(directory, options, progress=progress, shares=shares)
    if printing:
        to_file = output is not None
        renderer = importlib.import_module(f"{__package__}.render.{format.value}")  # render.json, ...
        multi = isinstance(result, MultiStepReport)
        looks: dict[str, Any] = {}
        if format is OutputFormat.terminal:
            width = 100 if to_file else _terminal_width()
            looks = {"width": width, "color": _use_color(color, to_file=to_file)}
        if format is OutputFormat.json:
            text = renderer.render_multi(result) if multi else renderer.render_report(result)
        elif multi:
            text = renderer.render_multi(result, failing_only=failing_only, **looks)
        else:
            text = renderer.render_report(result, fold=not all_ranks, **looks)
        _emit_report(text, output)
        trend = result.guard_trend if isinstance(result, MultiStepReport) else None
        if trend is not None and (format is not OutputFormat.terminal or output is not None):
            sys.stderr.write("".join(f"warning: {note}\n" for note in trend.notes))  # beside the report
    if _fails(result, fail_on):
        raise SystemExit(EXIT_FINDINGS)


def _use_color(choice: ColorChoice, *, to_file: bool = False) -> bool:
    """--color always or never decides; auto: never into a file, then NO_COLOR (set: off), then
    FORCE_COLOR (set: on, even piped; "0" or "false": off), then whether stdout is a terminal."""
    import os

    if choice is not ColorChoice.auto:
        return choice is ColorChoice.always
    if to_file or os.environ.get("NO_COLOR"):
        return False
    forced = os.environ.get("FORCE_COLOR")
    if forced:
        return forced.strip().lower() not in ("0", "false")
    return sys.stdout.isatty()


def _emit_report(text: str, output: Path | None) -> None:
    """Print the rendered report, or write it to --output; a failed write is a usage error."""
    try:
        _emit(text, output)
    except OSError as exc:
        problem = exc.strerror or exc
        where = "standard output" if output is None else output
        raise UsageError(f"{where}: cannot write the report ({problem})") from None
    if output is not None:
        sys.stderr.write(f"report written to {output}\n")


def _fails(result: Report | MultiStepReport, fail_on: FailOn) -> bool:
    """Whether a finding at or above --fail-on, or a failing step of a guarded run's trend, fails the
    check (a failing trend step as an error finding would: its codes are the step's errors, whether
    or not the guard dumped it)."""
    from .report.model import MultiStepReport, Severity

    if fail_on is FailOn.never:
        return False
    if isinstance(result, MultiStepReport) and result.guard_trend is not None and result.guard_trend.failing:
        return True
    reports = result.steps if isinstance(result, MultiStepReport) else (result,)
    failing = {Severity.ERROR} if fail_on is FailOn.error else {Severity.ERROR, Severity.WARNING}
    return any(f.severity in failing for report in reports for f in report.findings)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    options_metavar="[CODE]... | --all",
)
def explain(ctx: typer.Context) -> None:
    """Explain finding codes such as GA201: what each checks, why it matters, an example, how to fix it.

    With --all, list every code with its severity and title.
    """
    _explain(ctx.args)


def _explain(args: list[str]) -> None:
    """`gradaudit explain`, also called by `main` without typer (see `main`)."""
    from .checks.registry import BY_CODE, explain_all
    from .checks.registry import explain as explain_code

    options = [arg for arg in args if arg.startswith("-")]
    codes = [arg.upper() for arg in args if not arg.startswith("-")]
    bad = [option for option in options if option != "--all"]
    if bad:
        raise UsageError(f"explain: no such option {bad[0]!r}; give codes such as GA201, or --all")
    if options:
        if codes:
            raise UsageError("explain: give codes or --all, not both")
        _emit(explain_all())
        return
    if not codes:
        raise UsageError("give a code such as GA201, or --all to list every code")
    unknown = [code for code in codes if code not in BY_CODE]
    if unknown:
        raise UsageError(f"unknown code {unknown[0]!r}; run `gradaudit explain --all` for the list")
    _emit("\n".join(explain_code(code) for code in codes))


@app.command()
def demo(
    scenario: str | None = typer.Argument(None, help="A scenario name; see --list.", show_default=False),
    out_dir: Path | None = typer.Argument(None, help="Folder to write the dumps under.", show_default=False),
    list_scenarios: bool = typer.Option(False, "--list", help="List the scenarios and exit."),
) -> None:
    """Run one real training step with a known clipping mistake on local CPU ranks (gloo) and dump it.

    Writes OUT_DIR/SCENARIO/step_1/ (one file per rank)
    and OUT_DIR/SCENARIO/reference/step_1/ (the same step, unsharded, in one process),
    then prints the `gradaudit check` command to run next. Existing dumps are never overwritten.
    """
    from .demo import DemoRunFailed, get_scenario, run_demo, scenario_table

    if list_scenarios:
        _emit(scenario_table())
        return
    if scenario is None or out_dir is None:
        raise UsageError(
            "give a scenario and an output folder: gradaudit demo SCENARIO OUT_DIR (see gradaudit demo --list)"
        )
    chosen = get_scenario(scenario)
    try:
        result = run_demo(scenario, out_dir, progress=_print_progress)
    except DemoRunFailed as exc:
        sys.stderr.write(exc.detail)
        raise
    _print_progress(  # status lines, on stderr: stdout is for what a command prints as its result
        f"wrote {result.step_dir} ({chosen.world_size} ranks: {chosen.stack}; mistake: {chosen.mistake})\n"
        f"wrote {result.reference_step_dir} (the same step, unsharded, in one process)\n"
        f"next: {result.check_command}"
    )


def _print_progress(line: str) -> None:
    sys.stderr.write(line + "\n")


def _inventory(step: StepDump) -> Inventory:
    from .report.inventory import build_inventory

    return build_inventory(step, {rank: dump.pieces for rank, dump in step.ranks.items()})


def _terminal_width() -> int:
    import shutil

    return max(80, min(160, shutil.get_terminal_size((100, 24)).columns))


def _single_threaded_blas() -> None:
    """BLAS's own threads off in this process, before numpy loads it: the check spreads parameters
    over its own worker threads, and BLAS threads beside them spin and fight for the cores (a dense
    check measured 30x slower with OpenBLAS's default threads on a loaded 2-core machine)."""
    import os

    if "numpy" not in sys.modules:
        for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors exit 2 with one line; anything unexpected exits 3; SIGINT and SIGTERM
    exit 130 and 143 with one line, after every `finally` ran (no report file is left half written)."""
    _single_threaded_blas()
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    try:
        with _stopped_by_signals():
            code = _dispatch(args)
    except _Stopped as stopped:
        _fail(f"gradaudit: {STOPPED_BY[stopped.signum]}", 128 + stopped.signum, debug)
    except GradauditError as exc:
        _fail(f"error: {exc}", EXIT_BAD_INPUT, debug)
    except KeyboardInterrupt:  # where no handler could be installed (main called off the main thread)
        _fail(f"gradaudit: {STOPPED_BY[signal.SIGINT]}", 128 + signal.SIGINT, debug)
    except Exception as exc:  # noqa: BLE001 - the last line of defence
        # typer may bundle its own click: its usage errors are recognised by their class family
        if any(cls.__name__ == "ClickException" for cls in type(exc).__mro__) and hasattr(exc, "show"):
            exc.show()
            sys.exit(EXIT_BAD_INPUT)
        if type(exc).__name__ == "Abort":
            _fail("aborted", EXIT_BAD_INPUT, debug)
        _fail(
            f"internal error: {type(exc).__name__}: {exc}. This is a bug in gradaudit, not in your dump; "
            "re-run with --debug for the traceback and report it",
            EXIT_INTERNAL,
            debug,
        )
    if code == 128 + signal.SIGINT:  # typer's answer to a KeyboardInterrupt it caught
        _fail(f"gradaudit: {STOPPED_BY[signal.SIGINT]}", code, debug)
    sys.exit(code)


def _dispatch(args: list[str]) -> int:
    """Run the command `args` names; its exit code when it returns."""
    if args == ["--version"]:
        _print_version(True)  # answered before typer loads its parsers
    if args[:1] == ["explain"] and "--help" not in args:
        # typer coerces every parameter, even the group's --help flag, through pydantic, which would
        # double the time `explain` takes to print a paragraph; its arguments need no parser.
        _explain(args[1:])
        return EXIT_OK
    from typer.main import get_command

    from .cliparams import install_plain_params

    command = get_command(app)
    install_plain_params(command)  # no pydantic for paths, numbers and choices (see cliparams)
    returned = command.main(args=args, prog_name="gradaudit", standalone_mode=False)
    return returned if isinstance(returned, int) else EXIT_OK  # typer returns the code of an Exit


class _Stopped(BaseException):
    """SIGINT or SIGTERM, raised where the main thread is: not an Exception (no `except Exception`
    swallows it) nor a KeyboardInterrupt (typer turns that into a silent return)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    for other in STOPPED_BY:
        signal.signal(other, signal.SIG_DFL)  # a second signal stops the process at once
    raise _Stopped(signum)


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise _Stopped while the command runs; the previous handlers after it."""
    try:
        previous = {signum: signal.signal(signum, _raise_stopped) for signum in STOPPED_BY}
    except ValueError:  # not the main thread: signals are its program's to handle
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _fail(message: str, code: int, debug: bool) -> NoReturn:
    if debug:
        import traceback

        traceback.print_exc()
    from .render.text import printable

    sys.stderr.write(printable(message) + "\n")
    sys.exit(code)
