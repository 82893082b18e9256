"""Opening step folders: validate every rank file's header, cross-check ranks, read tensors lazily."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import os
import re
import stat
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

from ..errors import DumpFormatError, GradauditError, StepFolderError, shown
from ..model import Inconsistency, ParamInfo, RankFacts, StepFacts, Topology
from .columnar import ParamsCache
from .dump import RankDump, StepDump
from .header import (
    Header,
    OpenFileLimitError,
    check_density,
    first_line,
    open_regular_file,
    os_problem,
    parse_json,
    read_columns,
    read_raw_header_from,
    validate_tensors,
)
from .paramtable import SharedTables, is_table_file, resolve_shared, unreferenced_tables
from .schema import METADATA_KEY, decode_rank
from .writer import RANK_FILE_SUFFIX, STEP_DIR_PREFIX, is_temporary

_STEP_DIR = re.compile(rf"^{STEP_DIR_PREFIX}(\d+)$")
_RANK_FILE = re.compile(rf"^rank_(\d+){re.escape(RANK_FILE_SUFFIX)}$")


def load_rank_file(
    path: str | os.PathLike[str],
    *,
    params_cache: ParamsCache | None = None,
    tables: SharedTables | None = None,
) -> RankDump:
    """Read and validate one rank file's header; no tensor data is read (format-1.1 columns are
    metadata, and are read). `params_cache` shares decoded parameter tables between the ranks,
    `tables` the shared table files they name (each read once)."""
    path = str(path)
    with open_regular_file(path) as handle:
        dump, _ = _load_rank_from(handle, path, params_cache, tables)
    return dump


def _load_rank_from(
    handle: BinaryIO,
    path: str,
    params_cache: ParamsCache | None = None,
    tables: SharedTables | None = None,
) -> tuple[RankDump, Header]:
    raw = read_raw_header_from(handle, path)
    text = raw.metadata.get(METADATA_KEY)
    if text is None:
        raise DumpFormatError(
            path,
            "is a safetensors file without gradaudit metadata",
            "is it a model checkpoint? point gradaudit at a step_<N> dump folder",
        )
    header = validate_tensors(raw)
    check_density(text, path, "gradaudit metadata")
    try:
        doc = parse_json(text)
    except (ValueError, RecursionError) as exc:
        raise DumpFormatError(path, f"gradaudit metadata is not valid JSON ({first_line(exc)})") from None
    arrays = read_columns(handle, path, header) if isinstance(doc, dict) and "columnar" in doc else None
    if (
        arrays is not None
        and isinstance(doc["columnar"], dict)
        and isinstance(doc["columnar"].get("params"), dict)
    ):
        arrays = resolve_shared(doc, arrays, path, tables or SharedTables())
    dump = decode_rank(doc, path, num_bytes=header.file_size, arrays=arrays, params_cache=params_cache)
    _check_tensors_against_header(dump, header)
    return dataclasses.replace(dump, header_digest=raw.digest), header


def _check_tensors_against_header(dump: RankDump, header: Header) -> None:
    pieces = dump.pieces
    extras = pieces.extras
    for at in sorted({at for keys in extras.tensors.values() for at in keys}):
        info = pieces.params[int(pieces.rows[at, 0])]
        local_shape, dtype = pieces.local_shape(at), extras.dtypes.get(at, info.dtype)
        for keys in extras.tensors.values():
            key = keys.get(at)
            if key is None:
                continue
            entry = header.tensors.get(key)
            if entry is None:
                raise DumpFormatError(
                    dump.path,
                    f"piece {at} ({shown(info.name)}) names tensor {shown(key)}, which the file lacks",
                )
            if entry.shape != local_shape:
                raise DumpFormatError(
                    dump.path,
                    f"tensor {shown(key)} has shape {list(entry.shape)} but its piece says {list(local_shape)}",
                )
            if entry.dtype != dtype:
                raise DumpFormatError(
                    dump.path, f"tensor {shown(key)} is {entry.dtype} but its piece says {dtype}"
                )


def rank_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The candidate rank files of a step folder, and warnings about anything else found there."""
    files, warnings = [], []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            if is_temporary(entry.name):
                warnings.append(_temporary_warning(entry))
            continue
        if is_table_file(entry.name):
            continue  # a shared parameter table (paramtable.py), read through the rank files naming it
        if entry.name.endswith(RANK_FILE_SUFFIX):
            files.append(entry)
        else:
            warnings.append(f"{entry}: ignored, not a rank file (*{RANK_FILE_SUFFIX})")
    return files, warnings


def _listing_problem(directory: Path, exc: OSError) -> GradauditError:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return OpenFileLimitError(directory)
    return StepFolderError(
        f"{directory}: cannot be listed ({exc.strerror or exc}); check the folder's permissions"
    )


def _temporary_warning(entry: Path) -> str:
    try:
        size = f"{entry.lstat().st_size:,} bytes"
    except OSError:
        size = "size unknown"
    return (
        f"{entry}: ignored, an unfinished temporary file ({size}) of a writer that was killed or is still "
        "writing; delete it once no job writes to this folder"
    )


def _folder_problem(directory: Path) -> str | None:
    """Why `directory` cannot be opened as a folder, in words; None when it can."""
    try:
        mode = os.stat(directory).st_mode
    except ValueError:  # an embedded NUL byte
        return "is not a valid path"
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return "no such folder; point gradaudit at a step_<N> dump folder"
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop; point gradaudit at the real step_<N> folder"
        return f"{os_problem(exc)}"
    if stat.S_ISDIR(mode):
        return None
    if stat.S_ISREG(mode):
        return "is a file, not a folder; point gradaudit at the step_<N> folder that holds the rank files"
    return "is not a folder; point gradaudit at the step_<N> folder that holds the rank files"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off for the duration (restored as it was after).

    Loading and checking a many-rank step creates millions of small objects that all stay alive, and
    every collection of the oldest generation walks all of them again: 3.9 s of the 17 s of a
    stats-only check of 128 ranks went to collections that freed nothing. What is built here holds
    no reference cycles, so nothing accumulates meanwhile.

    On the way out, what was built is moved to the oldest generation (`gc.freeze` then
    `gc.unfreeze`, which only relinks lists): left in the youngest, the first collection after
    re-enabling walks all of it (1.1 s of a 512-rank check), and the next generation's again.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


LoadOutcome = RankDump | DumpFormatError | None
"""A rank file loaded, the reason it cannot be, or None: not loaded (after an unreadable one)."""
LoadFiles = Callable[..., list[LoadOutcome]]
"""`load_rank_files` or a drop-in (the scale-out's, which shares the files among processes)."""


def load_rank_files(
    paths: Sequence[Path], *, stop_at_error: bool = False, tables: SharedTables | None = None
) -> list[LoadOutcome]:
    """Load each rank file in turn: its RankDump, or the DumpFormatError that says why it cannot be
    read; with `stop_at_error`, None for the files after the first such one. The shared parameter
    tables read go into `tables` (the folder's unreferenced ones are warned about from it)."""
    outcomes: list[LoadOutcome] = []
    params_cache = ParamsCache()
    topologies: list[Topology] = []
    tables = SharedTables() if tables is None else tables
    failed = False
    for path in paths:
        if failed and stop_at_error:
            outcomes.append(None)
            continue
        try:
            dump = load_rank_file(path, params_cache=params_cache, tables=tables)
        except DumpFormatError as exc:
            outcomes.append(exc)
            failed = True
            continue
        outcomes.append(_with_shared_topology(dump, topologies))
    return outcomes


def _with_shared_topology(dump: RankDump, seen: list[Topology]) -> RankDump:
    """`dump` holding the very Topology of an earlier rank when the two are equal. Every rank's file
    lists the groups of every rank, so a copy per rank grows with the square of the world size
    (about 1 GiB of rank tuples for an HSDP step of 4096 ranks)."""
    for topology in seen:
        if topology is dump.topology:
            return dump
        if topology == dump.topology:
            return dataclasses.replace(dump, topology=topology)
    if len(seen) < 8:  # the distinct topologies of one step are few (one, or one per pipeline stage)
        seen.append(dump.topology)
    return dump


def load_step(
    directory: str | os.PathLike[str], *, allow_incomplete: bool = False, load_files: LoadFiles | None = None
) -> StepDump:
    """Load the headers of every rank file in a step folder into one StepDump.

    Files from different steps, runs or world sizes in one folder are refused (DumpFormatError):
    the writer never mixes them, so such a folder was assembled by hand, and any finding computed
    across them would describe no real step. A file that cannot be read stops the load, unless
    `allow_incomplete`: then a file named for its rank becomes a missing rank with its reason
    (`StepDump.unreadable_ranks`), any other a warning. Running out of file descriptors is never
    taken for a broken file. `load_files` replaces `load_rank_files` (the checks across ranks
    still run here, on every file of the folder).
    """
    directory = Path(directory)
    problem = _folder_problem(directory)
    if problem is not None:
        raise StepFolderError(f"{directory}: {problem}")
    try:
        files, warnings = rank_files(directory)
    except OSError as exc:
        raise _listing_problem(directory, exc) from None
    if not files:
        raise StepFolderError(
            f"{directory}: holds no rank files (*{RANK_FILE_SUFFIX}); is this a step_<N> dump folder?"
        )
    ranks: dict[int, RankDump] = {}
    unreadable: dict[int, str] = {}
    tables = SharedTables()
    with gc_paused():
        outcomes = (load_files or load_rank_files)(files, stop_at_error=not allow_incomplete, tables=tables)
        for path, dump in zip(files, outcomes, strict=True):
            assert dump is not None, "a file left unloaded before the first unreadable one"
            if isinstance(dump, DumpFormatError):
                if not allow_incomplete:
                    raise dump
                named = _RANK_FILE.match(path.name)
                reason = dump.problem + (f" ({dump.hint})" if dump.hint else "")
                if named:
                    unreadable[int(named.group(1))] = reason
                warnings.append(f"{path}: unreadable, audited as a missing rank: {reason}")
                continue
            if dump.rank in ranks:
                raise DumpFormatError(
                    path,
                    f"claims rank {dump.rank}, as does {Path(ranks[dump.rank].path).name}",
                    "remove the stray copy",
                )
            named = _RANK_FILE.match(path.name)
            if named and int(named.group(1)) != dump.rank:
                warnings.append(f"{path}: named for rank {int(named.group(1))} but holds rank {dump.rank}")
            ranks[dump.rank] = dump
        if not ranks:
            raise StepFolderError(
                f"{directory}: none of its {len(files)} rank files can be read ({warnings[-1]})"
            )
        warnings.extend(unreferenced_tables(directory, tables))
        refuse_mixed_runs(ranks)
        step = assemble_step(str(directory), ranks, warnings=tuple(warnings))
    if not unreadable:
        return step
    unreadable = {r: why for r, why in unreadable.items() if r not in step.ranks}
    world_size = max([step.world_size, *(r + 1 for r in unreadable)])
    missing = tuple(r for r in range(world_size) if r not in step.ranks)
    return dataclasses.replace(
        step, world_size=world_size, missing_ranks=missing, unreadable_ranks=dict(sorted(unreadable.items()))
    )


_RUN_IDENTITY: tuple[tuple[str, Callable[[RankDump], object]], ...] = (
    ("step", lambda d: d.step),
    ("run_id", lambda d: d.run_id),
    ("world_size", lambda d: d.world_size),
)


def refuse_mixed_runs(ranks: dict[int, RankDump]) -> None:
    """Raise DumpFormatError naming the odd file when the ranks come from different steps or runs."""
    for what, value_of in _RUN_IDENTITY:
        values = Counter(value_of(d) for _, d in sorted(ranks.items()) if value_of(d) is not None)
        if len(values) < 2:
            continue
        common = values.most_common(1)[0][0]
        dumps = [d for _, d in sorted(ranks.items())]
        reference = next(d for d in dumps if value_of(d) == common)
        odd = next(d for d in dumps if value_of(d) not in (None, common))
        raise DumpFormatError(
            odd.path,
            f"has {what} {shown(value_of(odd), 40)} but {Path(reference.path).name} has {what} {shown(common, 40)}",
            "a step folder must hold one step of one run; move the stray file out",
        )


def assemble_step(directory: str, ranks: dict[int, RankDump], *, warnings: tuple[str, ...] = ()) -> StepDump:
    """Cross-check the ranks of one step; disagreements become data (GA101), not errors."""
    return _assembled(StepDump, directory, ranks, warnings)


def assemble_facts(directory: str, ranks: dict[int, RankFacts]) -> StepFacts:
    """`assemble_step` of ranks known by their facts alone (the guard's gathered numbers)."""
    return _assembled(StepFacts, directory, ranks, ())


_Step = TypeVar("_Step", bound=StepFacts)


def _assembled(
    kind: type[_Step], directory: str, ranks: Mapping[int, RankFacts], warnings: tuple[str, ...]
) -> _Step:
    """A `kind` of these ranks: the step most ranks name, the world size, the missing ranks, what
    the ranks disagree on, and the ranks in order with every rank's topology holding every rank's
    view of its groups."""
    world_size = max(d.world_size for d in ranks.values())
    step = Counter(d.step for d in ranks.values()).most_common(1)[0][0]
    inconsistencies = []

    def compare(what: str, value_of: Callable[[RankFacts], object]) -> None:
        values = {rank: value_of(d) for rank, d in sorted(ranks.items())}
        present = {r: v for r, v in values.items() if v is not None}
        if len(set(present.values())) > 1:
            inconsistencies.append(Inconsistency(what=what, values={r: str(v) for r, v in present.items()}))

    compare("step", lambda d: d.step)
    compare("world_size", lambda d: d.world_size)
    compare("run_id", lambda d: d.run_id)
    compare("max_norm", lambda d: None if d.clip is None else d.clip.max_norm)
    compare("norm_type", lambda d: None if d.clip is None else d.clip.norm_type)
    compare("topology.mesh", lambda d: None if d.topology.mesh is None else repr(d.topology.mesh))
    compare("topology.norm_group", lambda d: d.topology.norm_group)
    merged_groups, conflicts = merge_groups(ranks)
    inconsistencies.extend(conflicts)
    inconsistencies.extend(_param_disagreements(ranks))
    merged: dict[int, Topology] = {}  # by the id of the rank's own (shared where equal, see load_rank_files)
    for d in ranks.values():
        if id(d.topology) not in merged:
            same = list(d.topology.groups.items()) == list(merged_groups.items())  # each listed all
            merged[id(d.topology)] = (
                d.topology if same else dataclasses.replace(d.topology, groups=merged_groups)
            )
    return kind(
        directory=directory,
        step=step,
        world_size=world_size,
        ranks={
            rank: d
            if d.topology is merged[id(d.topology)]
            else dataclasses.replace(d, topology=merged[id(d.topology)])
            for rank, d in sorted(ranks.items())
        },
        missing_ranks=tuple(r for r in range(world_size) if r not in ranks),
        inconsistencies=tuple(inconsistencies),
        warnings=warnings,
    )


def _param_disagreements(ranks: Mapping[int, RankFacts]) -> list[Inconsistency]:
    """Parameters whose global shape or dtype differs between ranks. Ranks holding an equal
    parameter table (consecutive ranks mostly share one) are looked at once."""
    tables: list[tuple[tuple[ParamInfo, ...], list[int]]] = []
    for rank, dump in sorted(ranks.items()):
        if tables and (tables[-1][0] is dump.params or tables[-1][0] == dump.params):
            tables[-1][1].append(rank)
        else:
            tables.append((dump.params, [rank]))
    seen: dict[str, dict[int, tuple[tuple[int, ...], str]]] = {}
    for table, (params, _) in enumerate(tables):
        for info in params:
            seen.setdefault(info.name, {})[table] = (tuple(info.global_shape), info.dtype)
    found = []
    for name in sorted(seen):
        by_table = seen[name]
        for what, index in (("shape", 0), ("dtype", 1)):
            if len({v[index] for v in by_table.values()}) > 1:
                values = sorted((r, str(v[index])) for t, v in by_table.items() for r in tables[t][1])
                found.append(Inconsistency(what=f"{what} of {name}", values=dict(values)))
    return found


def merge_groups(
    ranks: Mapping[int, RankFacts],
) -> tuple[dict[str, tuple[tuple[int, ...], ...]], list[Inconsistency]]:
    """Union of every rank's view of each named group (a rank may know only its own rank list).

    Two rank lists of one group that share a rank but differ are a contradiction (GA101 evidence).
    """
    merged: dict[str, set[tuple[int, ...]]] = {}
    shared: set[tuple[str, int]] = set()
    seen: set[tuple[str, tuple[tuple[int, ...], ...]]] = set()
    for dump in ranks.values():
        for name, lists in dump.topology.groups.items():
            # the same view as another rank's: shared (the guard's ranks share one) or equal (every
            # rank of a large job may list every group)
            if (name, id(lists)) in shared or (name, lists) in seen:
                continue
            shared.add((name, id(lists)))
            seen.add((name, lists))
            merged.setdefault(name, set()).update(tuple(sorted(set(g))) for g in lists)
    conflicts = []
    for name, rank_lists in sorted(merged.items()):
        owner: dict[int, tuple[int, ...]] = {}
        for members in sorted(rank_lists):
            for member in members:
                if member in owner and owner[member] != members:
                    conflicts.append(
                        Inconsistency(
                            what=f"topology group {name}",
                            values={member: f"{list(owner[member])} and {list(members)}"},
                        )
                    )
                owner.setdefault(member, members)
    return {name: tuple(sorted(rank_lists)) for name, rank_lists in sorted(merged.items())}, conflicts


def find_step_dirs(directory: str | os.PathLike[str]) -> list[Path]:
    """The step folders to check: the folder itself if it holds rank files, else its step_<N> children by N.

    A step_<N> entry that is not a usable folder (a broken link, a link loop) is still returned, so
    that loading it explains the problem instead of the step being skipped silently.
    """
    directory = Path(directory)
    if _folder_problem(directory) is not None:
        return [directory]
    try:
        entries = list(directory.iterdir())
    except OSError as exc:
        raise _listing_problem(directory, exc) from None
    if any(e.name.endswith(RANK_FILE_SUFFIX) for e in entries):
        return [directory]
    steps = sorted((int(m.group(1)), e) for e in entries if (m := _STEP_DIR.match(e.name)))
    return [e for _, e in steps] or [directory]
