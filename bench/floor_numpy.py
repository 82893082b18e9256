"""The floor of a whole `check` process: python bench/floor_numpy.py STEP_DIR

One single-threaded pass in numpy, written from the safetensors format itself (8-byte length, JSON
header, data) rather than with gradaudit's reader: every `::grad::` tensor of every rank file is
read with readinto into one reused buffer, widened into one reused float64 buffer (bf16 by a shift
into float32) and dotted with itself. Prints the L2 norm. Nothing a check that looks at every value
in float64 could skip.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # single-threaded, before numpy loads BLAS
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np

CHUNK = 1 << 16
STORAGE = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def main(directory: str) -> float:
    raw = np.empty(CHUNK * 8, dtype=np.uint8)
    wide = np.empty(CHUNK, dtype=np.float64)
    bf16 = np.empty(CHUNK, dtype=np.uint32)
    total = 0.0
    for path in sorted(Path(directory).glob("rank_*.safetensors")):
        with open(path, "rb", buffering=0) as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
            start = 8 + length
            for key in sorted(k for k in header if "::grad::" in k):
                entry = header[key]
                dtype = np.dtype(STORAGE[entry["dtype"]])
                begin, end = entry["data_offsets"]
                handle.seek(start + begin)
                remaining = end - begin
                while remaining:
                    size = min(remaining, CHUNK * dtype.itemsize)
                    if handle.readinto(memoryview(raw)[:size]) != size:
                        raise SystemExit(f"{path}: short read of {key}")
                    values = raw[:size].view(dtype)
                    part = wide[: values.size]
                    if entry["dtype"] == "BF16":
                        np.left_shift(values, 16, out=bf16[: values.size], dtype=np.uint32)
                        np.copyto(part, bf16[: values.size].view(np.float32))
                    else:
                        np.copyto(part, values)
                    total += float(np.dot(part, part))
                    remaining -= size
    return math.sqrt(total)


if __name__ == "__main__":
    print(f"{main(sys.argv[1]):.12g}")
