"""Reading a safetensors header ourselves: bounded, validated, and without touching tensor data.

Everything here treats the file as hostile: sizes are checked against the real file size before
anything is read or allocated, and every defect becomes a DumpFormatError naming the file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import DumpFormatError, GradauditError, clipped, shown

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""A header larger than this is refused before it is read (the same cap as safetensors itself)."""

MAX_DIMS = 64

SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
"""Every safetensors dtype we can size; gradaudit pieces are floating point (checked by the loader)."""

DTYPE_CODES = {name: code for code, (name, _) in SAFETENSORS_DTYPES.items()}
"""The safetensors code of each dtype name, for the writer."""


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    dtype: str
    """The dtype name ("float32", ...) of the safetensors dtype code."""
    shape: tuple[int, ...]
    """The tensor's shape as the header gives it."""
    begin: int
    """Byte offset of the data's first byte, counted from the start of the file."""
    end: int
    """Byte offsets of the data, counted from the start of the file."""


@dataclass(frozen=True, kw_only=True)
class RawHeader:
    """A parsed header whose tensor entries are not validated yet (so that a file that is not ours
    can be recognised as such before its tensors are judged)."""

    path: str
    """The file, for error messages."""
    metadata: Mapping[str, str]
    """The header's `__metadata__` entry (our JSON document is under METADATA_KEY)."""
    entries: Mapping[str, Any]
    """Tensor key -> its entry as parsed from the JSON, not yet validated."""
    data_start: int
    """Byte offset where the data section starts (8 + the header's length)."""
    file_size: int
    """Size of the file in bytes."""
    digest: bytes
    """The header's length and CRC-32: what tells a file changed on disk since it was loaded (not
    a defence against a forger, who could as well change the tensor data, which no check covers)."""


@dataclass(frozen=True, kw_only=True)
class Header:
    metadata: Mapping[str, str]
    """The header's `__metadata__` entry."""
    tensors: Mapping[str, TensorEntry]
    """Tensor key -> its validated entry; the entries tile the data section."""
    file_size: int
    """Size of the file in bytes."""


PREFIX = "__gradaudit__."
"""The key prefix of format 1.1's column tensors (dumpfile/columnar.py)."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not allowed")


BYTES_PER_CONTAINER = 8
"""JSON text may hold at most one list or object per this many bytes (dumps gradaudit writes hold about
one per 20 to 40): parsed, a list or object costs 56-72 bytes however little text it took, so this
keeps the memory of a parsed header within about 16 times its size (docs/SECURITY.md)."""


def check_density(text: str, path: str, what: str) -> None:
    """Refuse JSON text that would expand in memory far more than any dump (`what` names the part)."""
    containers = text.count("{") + text.count("[")
    if containers > len(text) // BYTES_PER_CONTAINER + 1024:
        raise DumpFormatError(
            path,
            f"{what} holds {containers:,} lists and objects in {len(text):,} bytes, more than one per "
            f"{BYTES_PER_CONTAINER} bytes",
            "no gradaudit dump is that dense; the file is not a valid gradaudit dump",
        )


def parse_json(text: str) -> Any:
    """Strict JSON: no NaN/Infinity tokens, no duplicate keys silently merged."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)  # in C: this hook runs for every object of a header of thousands
        if len(out) != len(pairs):
            seen = set()
            for key, _ in pairs:
                if key in seen:
                    raise ValueError(f"duplicate key {shown(key)}")
                seen.add(key)
        return out

    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=no_duplicates)


class OpenFileLimitError(GradauditError):
    """The process ran out of file descriptors: a limit of this machine, not a defect of the file."""

    def __init__(self, path: object) -> None:
        self.path = str(path)
        super().__init__(
            f"{self.path}: cannot be opened: this process reached its limit of {open_file_limit()} open "
            "files (not a problem of the file); raise it with `ulimit -n` and re-run"
        )


def open_file_limit() -> int | str:
    """The soft limit on open files, or "unknown"."""
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return "unknown"


def os_problem(exc: OSError) -> str:
    """What an OSError means for a dump file, in words."""
    if exc.errno == errno.ELOOP:
        return "is a symbolic link loop"
    if exc.errno == errno.ENOENT:
        return "does not exist (a broken symbolic link, or removed while reading)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "cannot be read: permission denied (check the file's permissions)"
    if exc.errno == errno.EISDIR:
        return "is a folder, not a rank file"
    return f"cannot be read: {exc.strerror or exc}"


def open_regular_file(path: str) -> BinaryIO:
    """Open a file for reading, refusing folders, pipes and devices (opening a pipe would block)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise OpenFileLimitError(path) from None
        raise DumpFormatError(path, os_problem(exc)) from None
    except ValueError:  # an embedded NUL byte
        raise DumpFormatError(path, "is not a valid path") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DumpFormatError(path, "is not a regular file (a folder, pipe or device)")
        return os.fdopen(fd, "rb", buffering=0)  # unbuffered: every read sees the file as it is now
    except BaseException:
        os.close(fd)
        raise


def read_exactly(handle: BinaryIO, count: int) -> bytes:
    """Up to `count` bytes from the current position; fewer only at the end of the file."""
    chunks, remaining = [], count
    while remaining > 0:
        chunk = handle.read(remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_raw_header_from(handle: BinaryIO, path: str) -> RawHeader:
    try:
        size = os.fstat(handle.fileno()).st_size
        if size < 8:
            raise DumpFormatError(path, f"is {size} bytes long, too short to be a safetensors file")
        handle.seek(0)
        (length,) = struct.unpack("<Q", read_exactly(handle, 8))
        if length > size - 8:
            raise DumpFormatError(
                path,
                f"header claims {length} bytes but the file has only {size - 8} after it",
                "the file is truncated",
            )
        if length > MAX_HEADER_BYTES:
            raise DumpFormatError(
                path, f"header claims {length} bytes, more than the {MAX_HEADER_BYTES} allowed"
            )
        raw = read_exactly(handle, length)
    except OSError as exc:
        raise DumpFormatError(path, os_problem(exc)) from None
    except struct.error:
        raise DumpFormatError(path, "header is cut short", "the file is truncated") from None
    if len(raw) != length:
        raise DumpFormatError(path, "header is cut short", "the file is truncated or changed while reading")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DumpFormatError(
            path, "header is not UTF-8 text", "the file is not a safetensors file"
        ) from None
    check_density(text, path, "header")
    try:
        doc = parse_json(text.rstrip(" "))
    except (ValueError, RecursionError) as exc:
        raise DumpFormatError(
            path,
            f"header is not valid JSON ({first_line(exc)})",
            "the file is corrupt or not a safetensors file",
        ) from None
    if not isinstance(doc, dict):
        raise DumpFormatError(path, "header is not a JSON object", "the file is not a safetensors file")
    metadata = doc.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DumpFormatError(path, "header __metadata__ is not a map of strings")
    entries = {k: v for k, v in doc.items() if k != "__metadata__"}
    return RawHeader(
        path=path,
        metadata=metadata,
        entries=entries,
        data_start=8 + length,
        file_size=size,
        digest=struct.pack("<QI", length, zlib.crc32(raw)),
    )


def first_line(exc: BaseException) -> str:
    """The first line of the exception's message (its type when it has none), clipped."""
    text = str(exc)
    return clipped(text.splitlines()[0] if text else type(exc).__name__)


def validate_tensors(raw: RawHeader) -> Header:
    """Check every tensor entry: known dtype, sane shape, data inside the file and of the right size,
    and the data section laid out as the safetensors library demands (see `_check_layout`)."""
    path = raw.path
    tensors: dict[str, TensorEntry] = {}
    data_size = raw.file_size - raw.data_start
    for key, entry in raw.entries.items():
        if not isinstance(entry, dict):
            raise DumpFormatError(path, f"tensor {shown(key)} has a malformed header entry")
        code = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
            raise DumpFormatError(
                path, f"tensor {shown(key)} has dtype {shown(code)}, which gradaudit cannot read"
            )
        if not (
            isinstance(shape, list)
            and len(shape) <= MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise DumpFormatError(path, f"tensor {shown(key)} has a malformed shape {shown(shape)}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise DumpFormatError(path, f"tensor {shown(key)} has malformed data_offsets {shown(offsets)}")
        name, itemsize = SAFETENSORS_DTYPES[code]
        if math.prod(shape) * itemsize != offsets[1] - offsets[0]:
            raise DumpFormatError(
                path,
                f"tensor {shown(key)} has shape {shown(shape)} but {offsets[1] - offsets[0]} bytes of data",
            )
        if offsets[1] > data_size:
            raise DumpFormatError(
                path,
                f"tensor {shown(key)} ends at byte {offsets[1]} of a {data_size}-byte data section",
                "the file is truncated",
            )
        tensors[key] = TensorEntry(
            dtype=name, shape=tuple(shape), begin=raw.data_start + offsets[0], end=raw.data_start + offsets[1]
        )
    _check_layout(path, tensors, raw.data_start, data_size)
    return Header(metadata=raw.metadata, tensors=tensors, file_size=raw.file_size)


def _check_layout(path: str, tensors: Mapping[str, TensorEntry], data_start: int, data_size: int) -> None:
    """The tensors' bytes tile the data section exactly, as the safetensors library requires: the
    first starts where the header ends, each next one where the previous ended, the last at the end
    of the file. So no two tensors share bytes and no junk hides between or after them."""
    expected = data_start
    for key, entry in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin < expected:
            raise DumpFormatError(
                path,
                f"tensor {shown(key)} overlaps the bytes of another tensor (data_offsets start at "
                f"{entry.begin - data_start}, before {expected - data_start})",
                "not a standard safetensors file; re-write it with the safetensors library",
            )
        if entry.begin > expected:
            raise DumpFormatError(
                path,
                f"{entry.begin - expected} bytes before tensor {shown(key)} belong to no tensor",
                "not a standard safetensors file; re-write it with the safetensors library",
            )
        expected = entry.end
    if expected != data_start + data_size:
        raise DumpFormatError(
            path,
            f"the last {data_start + data_size - expected} bytes of the file belong to no tensor",
            "not a standard safetensors file; re-write it with the safetensors library",
        )


def read_header(path: str) -> Header:
    """Parse and validate the header of a safetensors file; raise DumpFormatError on any defect."""
    with open_regular_file(path) as handle:
        return validate_tensors(read_raw_header_from(handle, path))


def read_columns(handle: BinaryIO, path: str, header: Header) -> dict[str, Any]:
    """The format-1.1 column tensors of a file as numpy arrays (their sizes were checked against
    the file by validate_tensors, so nothing here allocates more than the file holds)."""
    import numpy as np

    dtypes = {"int64": np.int64, "float64": np.float64, "uint8": np.uint8}
    columns = {key: entry for key, entry in header.tensors.items() if key.startswith(PREFIX)}
    for key, entry in columns.items():
        if entry.dtype not in dtypes:
            raise DumpFormatError(
                path, f"columnar tensor {shown(key)} is {entry.dtype}, not int64, float64 or uint8"
            )
    # One read from the first column to the last (a stats-only file's whole data section).
    begin = min((e.begin for e in columns.values()), default=0)
    try:
        handle.seek(begin)
        data = read_exactly(handle, max((e.end for e in columns.values()), default=0) - begin)
    except OSError as exc:
        raise DumpFormatError(path, os_problem(exc)) from None
    arrays: dict[str, Any] = {}
    for key, entry in columns.items():
        raw = data[entry.begin - begin : entry.end - begin]
        if len(raw) != entry.end - entry.begin:
            raise DumpFormatError(path, f"columnar tensor {shown(key)} is cut short", "the file is truncated")
        arrays[key] = np.frombuffer(raw, dtype=np.dtype(dtypes[entry.dtype]).newbyteorder("<")).reshape(
            entry.shape
        )
    return arrays
