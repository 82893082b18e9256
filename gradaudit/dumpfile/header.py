"""Reading a safetensors header ourselves: bounded, validated, and without touching tensor data."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import DumpFormatError

MAX_HEADER_BYTES = 256 * 1024 * 1024
"""A header larger than this is refused before it is read (safetensors itself caps at 100 MB)."""

SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
DTYPE_CODES = {name: code for code, (name, _) in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    """Byte offsets of the data, counted from the start of the file."""


@dataclass(frozen=True, kw_only=True)
class Header:
    metadata: Mapping[str, str]
    tensors: Mapping[str, TensorEntry]
    file_size: int


def _reject_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not allowed")


def parse_json(text: str) -> Any:
    """Strict JSON: no NaN/Infinity tokens, no duplicate keys silently merged."""

    def no_duplicates(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=no_duplicates)


def read_header(path: str) -> Header:
    """Parse and validate the header of a safetensors file; raise DumpFormatError on any defect."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                raise DumpFormatError(path, f"is {size} bytes long, too short to be a safetensors file")
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise DumpFormatError(
                    path, f"header claims {length} bytes but the file has only {size - 8} after it", "the file is truncated"
                )
            if length > MAX_HEADER_BYTES:
                raise DumpFormatError(path, f"header claims {length} bytes, more than the {MAX_HEADER_BYTES} allowed")
            raw = handle.read(length)
    except OSError as exc:
        raise DumpFormatError(path, f"cannot be read: {exc.strerror or exc}") from None
    if len(raw) != length:
        raise DumpFormatError(path, "header is cut short", "the file is truncated")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DumpFormatError(path, "header is not UTF-8 text", "the file is not a safetensors file") from None
    try:
        doc = parse_json(text.rstrip(" "))
    except (ValueError, RecursionError) as exc:
        raise DumpFormatError(path, f"header is not valid JSON ({exc})", "the file is corrupt or not a safetensors file") from None
    if not isinstance(doc, dict):
        raise DumpFormatError(path, "header is not a JSON object", "the file is not a safetensors file")
    return _validate(path, doc, data_start=8 + length, file_size=size)


def _validate(path: str, doc: dict, *, data_start: int, file_size: int) -> Header:
    metadata = doc.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise DumpFormatError(path, "header __metadata__ is not a map of strings")
    tensors: dict[str, TensorEntry] = {}
    data_size = file_size - data_start
    for key, entry in doc.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise DumpFormatError(path, f"tensor {key!r} has a malformed header entry")
        code = entry.get("dtype")
        shape = entry.get("shape")
        offsets = entry.get("data_offsets")
        if code not in SAFETENSORS_DTYPES:
            raise DumpFormatError(path, f"tensor {key!r} has dtype {code!r}, not a floating dtype gradaudit reads")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise DumpFormatError(path, f"tensor {key!r} has a malformed shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise DumpFormatError(path, f"tensor {key!r} has malformed data_offsets {offsets!r}")
        name, itemsize = SAFETENSORS_DTYPES[code]
        if math.prod(shape) * itemsize != offsets[1] - offsets[0]:
            raise DumpFormatError(
                path, f"tensor {key!r} has shape {shape} but {offsets[1] - offsets[0]} bytes of data"
            )
        if offsets[1] > data_size:
            raise DumpFormatError(
                path, f"tensor {key!r} ends at byte {offsets[1]} of a {data_size}-byte data section", "the file is truncated"
            )
        tensors[key] = TensorEntry(dtype=name, shape=tuple(shape), begin=data_start + offsets[0], end=data_start + offsets[1])
    return Header(metadata=metadata, tensors=tensors, file_size=file_size)
