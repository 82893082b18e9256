"""Opening step folders: validate every rank file's header, cross-check ranks, read tensors lazily."""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..errors import DumpFormatError, StepFolderError
from ..model import Inconsistency, RankDump, StepDump
from .header import Header, parse_json, read_header
from .schema import METADATA_KEY, decode_rank
from .writer import RANK_FILE_SUFFIX, STEP_DIR_PREFIX

if TYPE_CHECKING:
    import torch

_STEP_DIR = re.compile(rf"^{STEP_DIR_PREFIX}(\d+)$")


def load_rank_file(path: str | os.PathLike) -> RankDump:
    """Read and validate one rank file's header; no tensor data is read."""
    path = str(path)
    header = read_header(path)
    raw = header.metadata.get(METADATA_KEY)
    if raw is None:
        raise DumpFormatError(
            path, "is a safetensors file without gradaudit metadata", "is it a model checkpoint? point gradaudit at a step_<N> dump folder"
        )
    try:
        doc = parse_json(raw)
    except (ValueError, RecursionError) as exc:
        raise DumpFormatError(path, f"gradaudit metadata is not valid JSON ({exc})") from None
    dump = decode_rank(doc, path, num_bytes=header.file_size)
    _check_tensors_against_header(dump, header)
    return dump


def _check_tensors_against_header(dump: RankDump, header: Header) -> None:
    for piece in dump.pieces:
        for kind, key in piece.tensors.items():
            entry = header.tensors.get(key)
            if entry is None:
                raise DumpFormatError(dump.path, f"piece {piece.index} ({piece.param!r}) names tensor {key!r}, which the file lacks")
            if entry.shape != piece.local_shape:
                raise DumpFormatError(
                    dump.path,
                    f"tensor {key!r} has shape {list(entry.shape)} but its piece says {list(piece.local_shape)}",
                )
            if entry.dtype != piece.dtype:
                raise DumpFormatError(dump.path, f"tensor {key!r} is {entry.dtype} but its piece says {piece.dtype}")


def rank_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The candidate rank files of a step folder, and warnings about anything else found there."""
    files, warnings = [], []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.name.endswith(RANK_FILE_SUFFIX):
            files.append(entry)
        else:
            warnings.append(f"{entry}: ignored, not a rank file (*{RANK_FILE_SUFFIX})")
    return files, warnings


def load_step(directory: str | os.PathLike) -> StepDump:
    """Load the headers of every rank file in a step folder into one StepDump."""
    directory = Path(directory)
    if not directory.exists():
        raise StepFolderError(f"{directory}: no such folder; point gradaudit at a step_<N> dump folder")
    if not directory.is_dir():
        raise StepFolderError(f"{directory}: is not a folder; point gradaudit at the step_<N> folder that holds the rank files")
    try:
        files, warnings = rank_files(directory)
    except OSError as exc:
        raise StepFolderError(f"{directory}: cannot be listed: {exc.strerror or exc}") from None
    if not files:
        raise StepFolderError(f"{directory}: holds no rank files (*{RANK_FILE_SUFFIX}); is this a step_<N> dump folder?")
    ranks: dict[int, RankDump] = {}
    for path in files:
        dump = load_rank_file(path)
        if dump.rank in ranks:
            raise DumpFormatError(path, f"claims rank {dump.rank}, as does {ranks[dump.rank].path}", "remove the stray copy")
        ranks[dump.rank] = dump
    return assemble_step(str(directory), ranks, warnings=tuple(warnings))


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
    names = sorted({p.name for d in ranks.values() for p in d.params})
    for name in names:
        compare(f"shape of {name}", lambda d, n=name: None if d.param(n) is None else tuple(d.param(n).global_shape))
        compare(f"dtype of {name}", lambda d, n=name: None if d.param(n) is None else d.param(n).dtype)
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
    """The step folders to check: the folder itself if it holds rank files, else its step_<N> children by N."""
    directory = Path(directory)
    if not directory.is_dir():
        return [directory]
    try:
        entries = list(directory.iterdir())
    except OSError as exc:
        raise StepFolderError(f"{directory}: cannot be listed: {exc.strerror or exc}") from None
    if any(e.name.endswith(RANK_FILE_SUFFIX) for e in entries):
        return [directory]
    steps = sorted(
        (int(m.group(1)), e) for e in entries if (m := _STEP_DIR.match(e.name)) and e.is_dir()
    )
    return [e for _, e in steps] or [directory]


class TensorReader:
    """Reads dumped tensors lazily, one at a time or by chunks of rows, from the rank files of a step."""

    def __init__(self) -> None:
        self._handles: dict[str, object] = {}

    def _open(self, path: str):
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import safe_open

            try:
                handle = safe_open(path, framework="pt")
            except Exception as exc:  # safetensors raises its own error types for broken files
                raise DumpFormatError(path, f"cannot be opened for reading tensors ({exc})") from None
            self._handles[path] = handle
        return handle

    def read(self, path: str, key: str) -> "torch.Tensor":
        try:
            return self._open(path).get_tensor(key)
        except DumpFormatError:
            raise
        except Exception as exc:
            raise DumpFormatError(path, f"tensor {key!r} cannot be read ({exc})") from None

    def chunks(self, path: str, key: str, max_elements: int = 1 << 22) -> Iterator["torch.Tensor"]:
        """The tensor flattened row-major, in consecutive 1-D chunks of at most about `max_elements`."""
        try:
            view = self._open(path).get_slice(key)
            shape = view.get_shape()
            if len(shape) == 0:
                yield view[...].reshape(-1)
                return
            row = 1
            for d in shape[1:]:
                row *= d
            rows_per_chunk = max(1, max_elements // max(row, 1))
            for start in range(0, shape[0], rows_per_chunk):
                yield view[start : start + rows_per_chunk].reshape(-1)
        except DumpFormatError:
            raise
        except Exception as exc:
            raise DumpFormatError(path, f"tensor {key!r} cannot be read ({exc})") from None

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
