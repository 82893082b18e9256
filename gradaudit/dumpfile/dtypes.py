"""Dumped floating-point dtypes as numpy sees them, and their widening to float64 (no torch).

numpy has no bfloat16 or float8: their bytes are read as unsigned integers of the same width and
decoded here, bf16 by a shift into the high half of a float32, float8 through a 256-entry table
built from the bit layout (e4m3fn: bias 7, no infinities, S.1111.111 is nan; e5m2: the high byte
of a float16). Each is exact: every value of these formats is a float64.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

STORAGE: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float8_e4m3fn": np.dtype("u1"),
    "float8_e5m2": np.dtype("u1"),
}
"""How each dtype's bytes are read (little-endian, as safetensors stores them)."""

F64 = npt.NDArray[np.float64]


def _e4m3fn_table() -> F64:
    table = np.empty(256, dtype=np.float64)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[byte] = math.nan
        elif exponent == 0:
            table[byte] = sign * math.ldexp(mantissa, -9)
        else:
            table[byte] = sign * math.ldexp(8 + mantissa, exponent - 10)
    return table


def _e5m2_table() -> F64:
    return (np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float64)


FLOAT8_TABLES: dict[str, F64] = {"float8_e4m3fn": _e4m3fn_table(), "float8_e5m2": _e5m2_table()}


class Widener:
    """Widens raw chunks to float64 into buffers it reuses (one per slot), so that a chunk costs
    no allocation."""

    def __init__(self, chunk_elements: int) -> None:
        self.chunk_elements = chunk_elements
        self._buffers: dict[str, F64] = {}
        self._bf16: npt.NDArray[np.uint32] | None = None

    def buffer(self, slot: str, count: int) -> F64:
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.size < count:
            buffer = self._buffers[slot] = np.empty(max(count, self.chunk_elements), dtype=np.float64)
        return buffer[:count]

    def widen(self, raw: np.ndarray, dtype: str, slot: str) -> F64:
        """`raw` (read with STORAGE[dtype]) as float64 in the buffer `slot`; a float64 input is
        returned as it is (it is already a fresh array of its own)."""
        if dtype == "float64":
            same: F64 = raw
            return same
        out = self.buffer(slot, raw.size)
        if dtype == "bfloat16":
            if self._bf16 is None or self._bf16.size < raw.size:
                self._bf16 = np.empty(max(raw.size, self.chunk_elements), dtype=np.uint32)
            wide = self._bf16[: raw.size]
            np.left_shift(raw, 16, out=wide, dtype=np.uint32)
            with np.errstate(invalid="ignore"):  # a signalling nan stays a nan
                np.copyto(out, wide.view(np.float32))
        elif dtype in FLOAT8_TABLES:
            np.take(FLOAT8_TABLES[dtype], raw, out=out)
        else:
            np.copyto(out, raw)
        return out


def widen(raw: np.ndarray, dtype: str) -> F64:
    """`raw` as a new float64 array (for callers that keep the result)."""
    if dtype == "float64":
        copy: F64 = np.array(raw, dtype=np.float64)
        return copy
    return Widener(raw.size).widen(raw, dtype, "widen")  # a buffer of its own
