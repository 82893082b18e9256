"""Opening step folders: validate every rank file's header, cross-check ranks, read tensors lazily."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import math
import os
import re
import stat
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ..errors import DumpFormatError, StepFolderError
from ..model import Inconsistency, RankDump, StepDump
from .header import (
    ITEMSIZES,
    Header,
    TensorEntry,
    check_density,
    clipped,
    open_regular_file,
    os_problem,
    parse_json,
    read_raw_header_from,
    shown,
    validate_tensors,
)
from .schema import METADATA_KEY, decode_rank
from .writer import RANK_FILE_SUFFIX, STEP_DIR_PREFIX, is_temporary

if TYPE_CHECKING:
    import torch

_STEP_DIR = re.compile(rf"^{STEP_DIR_PREFIX}(\d+)$")
_RANK_FILE = re.compile(rf"^rank_(\d+){re.escape(RANK_FILE_SUFFIX)}$")


def load_rank_file(path: str | os.PathLike) -> RankDump:
    """Read and validate one rank file's header; no tensor data is read."""
    path = str(path)
    with open_regular_file(path) as handle:
        dump, _ = _load_rank_from(handle, path)
    return dump


def _load_rank_from(handle: BinaryIO, path: str) -> tuple[RankDump, Header]:
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
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DumpFormatError(path, f"gradaudit metadata is not valid JSON ({clipped(first_line)})") from None
    dump = decode_rank(doc, path, num_bytes=header.file_size)
    _check_tensors_against_header(dump, header)
    return dump, header


def _check_tensors_against_header(dump: RankDump, header: Header) -> None:
    for piece in dump.pieces:
        for key in piece.tensors.values():
            entry = header.tensors.get(key)
            if entry is None:
                raise DumpFormatError(
                    dump.path,
                    f"piece {piece.index} ({shown(piece.param)}) names tensor {shown(key)}, which the file lacks",
                )
            if entry.shape != piece.local_shape:
                raise DumpFormatError(
                    dump.path,
                    f"tensor {shown(key)} has shape {list(entry.shape)} but its piece says {list(piece.local_shape)}",
                )
            if entry.dtype != piece.dtype:
                raise DumpFormatError(
                    dump.path, f"tensor {shown(key)} is {entry.dtype} but its piece says {piece.dtype}"
                )


def rank_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The candidate rank files of a step folder, and warnings about anything else found there."""
    files, warnings = [], []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            if is_temporary(entry.name):
                warnings.append(_temporary_warning(entry))
            continue
        if entry.name.endswith(RANK_FILE_SUFFIX):
            files.append(entry)
        else:
            warnings.append(f"{entry}: ignored, not a rank file (*{RANK_FILE_SUFFIX})")
    return files, warnings


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
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def load_step(directory: str | os.PathLike) -> StepDump:
    """Load the headers of every rank file in a step folder into one StepDump.

    Files from different steps, runs or world sizes in one folder are refused (DumpFormatError):
    the writer never mixes them, so such a folder was assembled by hand, and any finding computed
    across them would describe no real step.
    """
    directory = Path(directory)
    problem = _folder_problem(directory)
    if problem is not None:
        raise StepFolderError(f"{directory}: {problem}")
    try:
        files, warnings = rank_files(directory)
    except OSError as exc:
        raise StepFolderError(
            f"{directory}: cannot be listed ({exc.strerror or exc}); check the folder's permissions"
        ) from None
    if not files:
        raise StepFolderError(
            f"{directory}: holds no rank files (*{RANK_FILE_SUFFIX}); is this a step_<N> dump folder?"
        )
    ranks: dict[int, RankDump] = {}
    with gc_paused():
        for path in files:
            dump = load_rank_file(path)
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
        refuse_mixed_runs(ranks)
        return assemble_step(str(directory), ranks, warnings=tuple(warnings))


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
    world_sizes = Counter(d.world_size for d in ranks.values())
    world_size = max(world_sizes)
    steps = Counter(d.step for d in ranks.values())
    step = steps.most_common(1)[0][0]
    inconsistencies = []

    def compare(what: str, value_of) -> None:
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
    missing = tuple(r for r in range(world_size) if r not in ranks)
    ranks = {
        rank: dataclasses.replace(d, topology=dataclasses.replace(d.topology, groups=merged_groups))
        for rank, d in ranks.items()
    }
    return StepDump(
        directory=directory,
        step=step,
        world_size=world_size,
        ranks=dict(sorted(ranks.items())),
        missing_ranks=missing,
        inconsistencies=tuple(inconsistencies),
        warnings=warnings,
    )


def _param_disagreements(ranks: dict[int, RankDump]) -> list[Inconsistency]:
    """Parameters whose global shape or dtype differs between ranks, in one pass over all params."""
    seen: dict[str, dict[int, tuple]] = {}
    for rank, dump in sorted(ranks.items()):
        for info in dump.params:
            seen.setdefault(info.name, {})[rank] = (tuple(info.global_shape), info.dtype)
    found = []
    for name in sorted(seen):
        by_rank = seen[name]
        for what, index in (("shape", 0), ("dtype", 1)):
            if len({v[index] for v in by_rank.values()}) > 1:
                found.append(
                    Inconsistency(
                        what=f"{what} of {name}", values={r: str(v[index]) for r, v in by_rank.items()}
                    )
                )
    return found


def merge_groups(ranks: dict[int, RankDump]) -> tuple[dict, list[Inconsistency]]:
    """Union of every rank's view of each named group (a rank may know only its own rank list).

    Two rank lists of one group that share a rank but differ are a contradiction (GA101 evidence).
    """
    merged: dict[str, set[tuple[int, ...]]] = {}
    for dump in ranks.values():
        for name, lists in dump.topology.groups.items():
            merged.setdefault(name, set()).update(tuple(sorted(set(g))) for g in lists)
    conflicts = []
    for name, lists in sorted(merged.items()):
        owner: dict[int, tuple[int, ...]] = {}
        for members in sorted(lists):
            for member in members:
                if member in owner and owner[member] != members:
                    conflicts.append(
                        Inconsistency(
                            what=f"topology group {name}",
                            values={member: f"{list(owner[member])} and {list(members)}"},
                        )
                    )
                owner.setdefault(member, members)
    return {name: tuple(sorted(lists)) for name, lists in sorted(merged.items())}, conflicts


def find_step_dirs(directory: str | os.PathLike) -> list[Path]:
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
        raise StepFolderError(
            f"{directory}: cannot be listed ({exc.strerror or exc}); check the folder's permissions"
        ) from None
    if any(e.name.endswith(RANK_FILE_SUFFIX) for e in entries):
        return [directory]
    steps = sorted((int(m.group(1)), e) for e in entries if (m := _STEP_DIR.match(e.name)))
    return [e for _, e in steps] or [directory]


class TensorReader:
    """Reads dumped tensors lazily, one at a time or by chunks of rows, from the rank files of a step.

    Reads are plain bounded file reads, not a memory map: a file truncated or rewritten after it was
    loaded gives a DumpFormatError naming it (a memory map would kill the process with SIGBUS).
    Each file's header is validated again when it is first opened; given the `step` it was loaded
    as, the reader also refuses a file whose pieces changed since.
    """

    def __init__(self, step: StepDump | None = None) -> None:
        self._expected = {d.path: d for d in step.ranks.values()} if step is not None else {}
        self._files: dict[str, tuple[BinaryIO, Header]] = {}

    def _open(self, path: str) -> tuple[BinaryIO, Header]:
        opened = self._files.get(path)
        if opened is None:
            handle = open_regular_file(path)
            try:
                dump, header = _load_rank_from(handle, path)
                expected = self._expected.get(path)
                if expected is not None and (
                    dump.pieces != expected.pieces or dump.num_bytes != expected.num_bytes
                ):
                    raise DumpFormatError(
                        path,
                        "changed on disk after it was loaded",
                        "let the dump finish before checking it, then re-run",
                    )
            except BaseException:
                handle.close()
                raise
            opened = self._files[path] = (handle, header)
        return opened

    def _entry(self, path: str, key: str) -> tuple[BinaryIO, TensorEntry]:
        handle, header = self._open(path)
        entry = header.tensors.get(key)
        if entry is None:
            raise DumpFormatError(path, f"has no tensor {shown(key)}")
        return handle, entry

    def _read(
        self, path: str, key: str, handle: BinaryIO, entry: TensorEntry, first: int, count: int
    ) -> torch.Tensor:
        """Elements [first, first + count) of the flattened tensor, as a 1-D tensor."""
        import torch

        dtype = getattr(torch, entry.dtype)
        itemsize = ITEMSIZES[entry.dtype]
        offset, num_bytes = entry.begin + first * itemsize, count * itemsize
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        done = 0
        try:
            handle.seek(offset)
            while done < num_bytes:
                got = handle.readinto(view[done:])
                if not got:
                    raise DumpFormatError(
                        path,
                        f"tensor {shown(key)} is cut short at byte {offset + done}",
                        "the file was truncated or rewritten after it was checked",
                    )
                done += got
        except OSError as exc:
            raise DumpFormatError(path, os_problem(exc)) from None
        return buffer.view(dtype)

    def read(self, path: str, key: str) -> torch.Tensor:
        handle, entry = self._entry(path, key)
        return self._read(path, key, handle, entry, 0, math.prod(entry.shape)).reshape(entry.shape)

    def chunks(self, path: str, key: str, max_elements: int = 1 << 22) -> Iterator[torch.Tensor]:
        """The tensor flattened row-major, in consecutive 1-D chunks of whole rows of at most about
        `max_elements` (an empty tensor gives one empty chunk)."""
        handle, entry = self._entry(path, key)
        numel = math.prod(entry.shape)
        if numel == 0 or len(entry.shape) == 0:
            yield self._read(path, key, handle, entry, 0, numel)
            return
        row = numel // entry.shape[0]
        rows_per_chunk = max(1, max_elements // row)
        for start in range(0, entry.shape[0], rows_per_chunk):
            stop = min(start + rows_per_chunk, entry.shape[0])
            yield self._read(path, key, handle, entry, start * row, (stop - start) * row)

    def read_range(self, path: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the tensor flattened row-major, reading only those bytes."""
        handle, entry = self._entry(path, key)
        numel = math.prod(entry.shape)
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"range [{start}, {stop}) is outside tensor {key!r} of {numel} elements")
        return self._read(path, key, handle, entry, start, stop - start)

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
