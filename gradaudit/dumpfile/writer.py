"""Writing one rank's dump file from plain tensors and a RankDump description."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DumpFormatError, GradauditError
from ..model import RankDump
from .columnar import to_columns
from .paramtable import TABLE_COLUMNS, publish_table, table_file_bytes, table_reference
from .schema import METADATA_KEY, decode_rank, encode_rank

if TYPE_CHECKING:
    import numpy as np
    import torch

STEP_DIR_PREFIX = "step_"
RANK_FILE_SUFFIX = ".safetensors"


def step_dir(out_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(out_dir) / f"{STEP_DIR_PREFIX}{step}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}{RANK_FILE_SUFFIX}"


def tensor_key(param: str, kind: str, piece_index: int) -> str:
    """The safetensors key of one tensor: it names the parameter and what the tensor is."""
    return f"{param}::{kind}::{piece_index}"


class UnreadableDumpError(GradauditError):
    """The dump about to be written breaks a rule of the format (the reader's own checks say which)."""


class DumpExistsError(GradauditError):
    """A dump for this rank and step is already there; gradaudit never overwrites one silently."""


def write_rank_file(
    directory: str | os.PathLike[str],
    dump: RankDump,
    tensors: Mapping[tuple[int, str], torch.Tensor],
    *,
    overwrite: bool = False,
    columnar: bool = True,
    share_params: bool = True,
) -> Path:
    """Write `dump` and its tensors (keyed by (piece index, kind)) to `directory/rank_NNNNN.safetensors`.

    The file appears under its final name only when complete (written to a temporary name, then
    linked), and an existing file is never replaced unless `overwrite` is set. A format-1.1 file's
    parameter table goes into the step's shared table file when `share_params` and that file can be
    created or already holds the same table (paramtable.py); otherwise into the rank file.
    Returns the path written.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    pieces = []
    payload: dict[str, torch.Tensor] = {}
    by_index = {p.index: p for p in dump.pieces}
    for index, _kind in tensors:
        if index not in by_index:
            raise ValueError(f"tensor given for piece {index}, but the dump has no such piece")
    for piece in dump.pieces:
        keys = dict(piece.tensors)
        for kind in ("grad", "grad_clipped", "param_before", "param_after"):
            tensor = tensors.get((piece.index, kind))
            if tensor is None:
                continue
            if tuple(tensor.shape) != piece.local_shape:
                raise ValueError(
                    f"{piece.param!r} {kind}: tensor shape {tuple(tensor.shape)} differs from the piece's "
                    f"local shape {piece.local_shape}"
                )
            if str(tensor.dtype).removeprefix("torch.") != piece.dtype:
                raise ValueError(
                    f"{piece.param!r} {kind}: tensor dtype {tensor.dtype} differs from {piece.dtype}"
                )
            key = tensor_key(piece.param, kind, piece.index)
            payload[key] = tensor.detach().to("cpu").contiguous()
            keys[kind] = key
        pieces.append(dataclasses.replace(piece, tensors=keys))
    dump = dataclasses.replace(dump, pieces=tuple(pieces))
    final = directory / rank_file_name(dump.rank)
    document = encode_rank(dump)
    try:
        decode_rank(json.loads(json.dumps(document, allow_nan=False)), str(final))
    except DumpFormatError as exc:
        raise UnreadableDumpError(
            f"{final}: not written, because gradaudit's reader would refuse it: {exc.problem}"
        ) from None
    columns = None if payload or not columnar else to_columns(dump)
    arrays: dict[str, np.ndarray] = {}
    if columns is not None:  # format 1.1: stats-only pieces as binary columns (see columnar.py)
        document["columnar"], arrays = columns
        document["pieces"] = []
        if document["columnar"]["params"] == "columns":
            document["params"] = []

    directory.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise DumpExistsError(
            f"{final}: a dump of rank {dump.rank} for step {dump.step} already exists; "
            "choose another output folder or delete it first"
        )
    _remove_stale_temporaries(directory, final.name)
    if share_params and columns is not None and document["columnar"]["params"] == "columns":
        data = table_file_bytes(arrays)
        reference = table_reference(data)
        if publish_table(directory, reference["file"], data, directory / temporary_name(reference["file"])):
            document["columnar"] = {**document["columnar"], "params": reference}
            arrays = {key: value for key, value in arrays.items() if key not in TABLE_COLUMNS}
    if columns is not None:
        import torch

        payload = {key: torch.from_numpy(array.copy()) for key, array in arrays.items()}
    metadata = {METADATA_KEY: json.dumps(document, sort_keys=True, allow_nan=False)}
    temporary = directory / temporary_name(final.name)
    try:
        mode = _mode_the_umask_gives(temporary)
        save_file(payload, str(temporary), metadata=metadata)
        os.chmod(temporary, mode)  # safetensors writes 0600; a dump is for sharing, as the umask says
        if overwrite:
            os.replace(temporary, final)
        else:
            _publish_without_overwrite(temporary, final, dump)
    finally:
        if temporary.exists():
            temporary.unlink()
    return final


TEMPORARY_MARK = ".tmp-"
"""A rank file being written is `.<rank file name>.tmp-<host>-<pid>` until it is complete."""


def temporary_name(final_name: str) -> str:
    host = "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname())[:64]
    return f".{final_name}{TEMPORARY_MARK}{host}-{os.getpid()}"


def is_temporary(name: str) -> bool:
    """Whether a file name is one of the writer's temporaries (complete or not), of a rank file or a
    shared parameter table."""
    return name.startswith((".rank_", ".params_")) and TEMPORARY_MARK in name


def _remove_stale_temporaries(directory: Path, final_name: str) -> None:
    """Remove this rank's temporaries that a writer on this host left when it was killed mid-write."""
    prefix = temporary_name(final_name).rsplit("-", 1)[0] + "-"
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(directory / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


def _mode_the_umask_gives(path: Path) -> int:
    """Create `path` empty as a plain open() would (0666 less the umask) and return its mode."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _publish_without_overwrite(temporary: Path, final: Path, dump: RankDump) -> None:
    """Give the finished file its final name, failing if that name is taken meanwhile."""
    try:
        os.link(temporary, final)
    except FileExistsError:
        raise DumpExistsError(
            f"{final}: a dump of rank {dump.rank} for step {dump.step} appeared while writing; "
            "choose another output folder"
        ) from None
    except OSError:
        # Filesystems without hard links: a rename after the existence check above.
        if final.exists():
            raise DumpExistsError(f"{final}: a dump of rank {dump.rank} already exists") from None
        os.rename(temporary, final)
