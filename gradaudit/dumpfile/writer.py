"""Writing one rank's dump file from plain tensors and a RankDump description."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ..errors import DumpFormatError, GradauditError
from ..model import TENSOR_KINDS, TensorKind
from .columnar import from_columns, to_columns
from .dump import RankDump, as_columns
from .header import DTYPE_CODES
from .paramtable import TABLE_COLUMNS, publish_table, table_file_bytes, table_reference
from .schema import METADATA_KEY, decode_rank, encode_rank
from .tempfiles import (
    TEMPORARY_MARK,
    create_exclusively,
    is_temporary,
    remove_stale_temporaries,
    temporary_name,
)

__all__ = ["TEMPORARY_MARK", "is_temporary", "temporary_name", "write_rank_file", "write_safetensors"]

if TYPE_CHECKING:
    import numpy as np
    import torch

STEP_DIR_PREFIX = "step_"
RANK_FILE_SUFFIX = ".safetensors"


def step_dir(out_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(out_dir) / f"{STEP_DIR_PREFIX}{step}"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}{RANK_FILE_SUFFIX}"


def tensor_key(param: str, kind: TensorKind, piece_index: int) -> str:
    """The safetensors key of one tensor: it names the parameter and what the tensor is."""
    return f"{param}::{kind}::{piece_index}"


class UnreadableDumpError(GradauditError):
    """The dump about to be written breaks a rule of the format (the reader's own checks say which)."""


class DumpExistsError(GradauditError):
    """A dump for this rank and step is already there; gradaudit never overwrites one silently."""


def write_rank_file(
    directory: str | os.PathLike[str],
    dump: RankDump,
    tensors: Mapping[tuple[int, TensorKind], torch.Tensor],
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
    directory = Path(directory)
    final = directory / rank_file_name(dump.rank)
    if dump.pieces.params != tuple(dump.params):
        raise ValueError("the columnar pieces refer to another parameter list than the dump's")
    dump, payload = _with_tensor_keys(dump, tensors)
    columns = None if payload or not columnar else to_columns(dump)
    # The JSON document is checked by the reader's own decoder; the columns below by its column checks.
    shown = dump if columns is None else dataclasses.replace(dump, pieces=as_columns((), ()), params=())
    document = encode_rank(shown)
    text = json.dumps(document, sort_keys=True, allow_nan=False)
    try:
        if shown is not dump and len({p.name for p in dump.params}) < len(dump.params):
            raise DumpFormatError(str(final), "a parameter is listed twice")
        decode_rank(json.loads(text), str(final))
        if columns is not None:
            from_columns(columns[0], columns[1], dump.params, str(final))
    except DumpFormatError as exc:
        raise UnreadableDumpError(
            f"{final}: not written, because gradaudit's reader would refuse it: {exc.problem}"
        ) from None
    arrays: dict[str, np.ndarray] = {}
    if columns is not None:  # format 1.1: stats-only pieces as binary columns (see columnar.py)
        document["columnar"], arrays = columns

    directory.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise DumpExistsError(
            f"{final}: a dump of rank {dump.rank} for step {dump.step} already exists; "
            "choose another output folder or delete it first"
        )
    remove_stale_temporaries(directory, final.name)
    if share_params and columns is not None:
        data = table_file_bytes(arrays)
        reference = table_reference(data)
        if publish_table(directory, reference["file"], data, directory / temporary_name(reference["file"])):
            document["columnar"] = {**document["columnar"], "params": reference}
            arrays = {key: value for key, value in arrays.items() if key not in TABLE_COLUMNS}
    tensors_out: dict[str, np.ndarray | torch.Tensor] = {**payload, **arrays}
    if columns is not None:  # the document changed above
        text = json.dumps(document, sort_keys=True, allow_nan=False)
    metadata = {METADATA_KEY: text}
    temporary = directory / temporary_name(final.name)
    fd = create_exclusively(temporary)  # ours from here on: removed below whatever happens
    try:
        with os.fdopen(fd, "wb", buffering=0) as handle:
            write_safetensors(handle, tensors_out, metadata)
        if overwrite:
            os.replace(temporary, final)
        else:
            _publish_without_overwrite(temporary, final, dump)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return final


def _with_tensor_keys(
    dump: RankDump, tensors: Mapping[tuple[int, TensorKind], torch.Tensor]
) -> tuple[RankDump, dict[str, torch.Tensor]]:
    """`dump` with each piece naming its tensors' safetensors keys, and those tensors (CPU, contiguous)
    by key, after checking each against its piece."""
    if not tensors:
        return dump, {}
    pieces = dump.pieces
    for index, _kind in tensors:
        if not 0 <= index < len(pieces):
            raise ValueError(f"tensor given for piece {index}, but the dump has no such piece")
    payload: dict[str, torch.Tensor] = {}
    keys: dict[TensorKind, dict[int, str]] = {}
    for position in sorted({index for index, _ in tensors}):
        info = pieces.params[int(pieces.rows[position, 0])]
        local_shape, dtype = pieces.local_shape(position), pieces.extras.dtypes.get(position, info.dtype)
        for kind in TENSOR_KINDS:
            tensor = tensors.get((position, kind))
            if tensor is None:
                continue
            if tuple(tensor.shape) != local_shape:
                raise ValueError(
                    f"{info.name!r} {kind}: tensor shape {tuple(tensor.shape)} differs from the piece's "
                    f"local shape {local_shape}"
                )
            if str(tensor.dtype).removeprefix("torch.") != dtype:
                raise ValueError(f"{info.name!r} {kind}: tensor dtype {tensor.dtype} differs from {dtype}")
            key = tensor_key(info.name, kind, position)
            payload[key] = tensor.detach().to("cpu").contiguous()
            keys.setdefault(kind, {})[position] = key
    return dataclasses.replace(dump, pieces=pieces.with_tensors(keys)), payload


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


_WRITE_BYTES = 64 << 20


def write_safetensors(
    handle: BinaryIO, tensors: Mapping[str, np.ndarray | torch.Tensor], metadata: Mapping[str, str]
) -> None:
    """Write a safetensors file of `tensors` (CPU, contiguous) to `handle`, from their own memory.

    Written here rather than by safetensors' save_file, which writes its own hidden `.tmpXXXXXX` beside
    the target and renames it over it: a writer killed mid-write left the whole file there, under a
    name gradaudit neither chose nor cleaned. The layout is the library's: an 8-byte little-endian
    header length, the JSON header padded with spaces to 8 bytes, the tensors' bytes back to back."""
    layout: dict[str, object] = {"__metadata__": dict(metadata)}
    blobs: list[memoryview] = []
    offset = 0
    for key in sorted(tensors):
        code, shape, blob = _raw(tensors[key])
        layout[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + blob.nbytes]}
        blobs.append(blob)
        offset += blob.nbytes
    header = json.dumps(layout, separators=(",", ":"), allow_nan=False).encode()
    header += b" " * (-len(header) % 8)
    _write_all(handle, memoryview(len(header).to_bytes(8, "little") + header))
    for blob in blobs:
        for start in range(0, blob.nbytes, _WRITE_BYTES):
            _write_all(handle, blob[start : start + _WRITE_BYTES])


def _raw(value: np.ndarray | torch.Tensor) -> tuple[str, tuple[int, ...], memoryview]:
    """(safetensors dtype code, shape, the bytes as a flat memoryview) of a CPU array or tensor."""
    import numpy as np

    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        code = DTYPE_CODES[array.dtype.name]
        return code, tuple(array.shape), array.reshape(-1).view(np.uint8).data
    import torch

    tensor = value.detach().to("cpu").contiguous()
    code = DTYPE_CODES[str(tensor.dtype).removeprefix("torch.")]
    flat = tensor.reshape(-1).view(torch.uint8).numpy()
    return code, tuple(tensor.shape), flat.data


def _write_all(handle: BinaryIO, data: memoryview) -> None:
    while data.nbytes:
        written = handle.write(data)
        if written is None:
            raise BlockingIOError("the rank file would block")
        data = data[written:]
