"""Reading dumped tensors by element ranges, with numpy, from a bounded number of open files.

Reads are plain bounded file reads, not a memory map: a file truncated or rewritten after it was
loaded gives a DumpFormatError naming it (a memory map would kill the process with SIGBUS). Each
file's header is validated when it is first opened; given the `step` it was loaded as, the reader
also refuses a file whose pieces changed since. At most `max_open` files are open at once (the
least recently used is closed first), so a step of any number of ranks reads under any sane limit
on open files; a file closed and opened again must still be the same file (inode, size, mtime).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ..errors import DumpFormatError, shown
from .dtypes import STORAGE
from .header import (
    Header,
    TensorEntry,
    open_regular_file,
    os_problem,
    read_raw_header_from,
    validate_tensors,
)

if TYPE_CHECKING:
    import torch

    from .dump import StepDump

MAX_OPEN_FILES = 32
"""Files kept open at once per reader (one reader per worker thread): enough for the pieces a worker
reads side by side; fewer under a low limit on open files (see `default_max_open`)."""


def default_max_open() -> int:
    """MAX_OPEN_FILES, or an eighth of the soft limit on open files when that is lower."""
    from .header import open_file_limit

    limit = open_file_limit()
    return MAX_OPEN_FILES if isinstance(limit, str) or limit <= 0 else max(1, min(MAX_OPEN_FILES, limit // 8))


_Identity = tuple[int, int, int]
"""(inode, size, mtime_ns) of an open file."""


def _identity(handle: BinaryIO) -> _Identity:
    info = os.fstat(handle.fileno())
    return info.st_ino, info.st_size, info.st_mtime_ns


class TensorReader:
    """Reads tensors of a step's rank files as numpy arrays (and, for callers that want them, as
    torch tensors); see the module docstring."""

    def __init__(self, *steps: StepDump | None, max_open: int | None = None) -> None:
        """`steps`: the loaded steps whose files this reads (a file changed since is refused)."""
        self._expected = {d.path: d for step in steps if step is not None for d in step.ranks.values()}
        self._headers: dict[str, tuple[Header, _Identity]] = {}
        self._open_files: OrderedDict[str, BinaryIO] = OrderedDict()
        self._max_open = max(1, default_max_open() if max_open is None else max_open)
        self._scratch: dict[str, np.ndarray] = {}

    def another(self) -> TensorReader:
        """A reader of the same steps with its own open files and buffers (one per thread)."""
        twin = TensorReader(max_open=self._max_open)
        twin._expected = self._expected
        return twin

    def _handle(self, path: str) -> tuple[BinaryIO, Header]:
        handle = self._open_files.get(path)
        if handle is not None:
            self._open_files.move_to_end(path)
            return handle, self._headers[path][0]
        while len(self._open_files) >= self._max_open:
            _, oldest = self._open_files.popitem(last=False)
            oldest.close()
        handle = open_regular_file(path)
        try:
            known = self._headers.get(path)
            if known is None:
                self._headers[path] = (self._validate(handle, path), _identity(handle))
            elif _identity(handle) != known[1]:
                raise DumpFormatError(
                    path, "changed on disk while it was read", "let the dump finish, then re-run"
                )
        except BaseException:
            handle.close()
            raise
        self._open_files[path] = handle
        return handle, self._headers[path][0]

    def _validate(self, handle: BinaryIO, path: str) -> Header:
        """The file's header, refused when the step it was loaded as says it changed since: by the
        header's digest when every piece is in the header (format 1.0), else by loading it again."""
        from .columnar import PREFIX
        from .loader import _load_rank_from

        expected = self._expected.get(path)
        if expected is None:
            return _load_rank_from(handle, path)[1]
        raw = read_raw_header_from(handle, path)
        header = validate_tensors(raw)
        if expected.header_digest and not any(key.startswith(PREFIX) for key in header.tensors):
            unchanged = raw.digest == expected.header_digest
        else:
            dump = _load_rank_from(handle, path)[0]
            unchanged = dump.pieces == expected.pieces
        if not unchanged or raw.file_size != expected.num_bytes:
            raise DumpFormatError(
                path,
                "changed on disk after it was loaded",
                "let the dump finish before checking it, then re-run",
            )
        return header

    def entry(self, path: str, key: str) -> TensorEntry:
        return self._entry(path, key)[1]

    def _entry(self, path: str, key: str) -> tuple[BinaryIO, TensorEntry]:
        handle, header = self._handle(path)
        entry = header.tensors.get(key)
        if entry is None:
            raise DumpFormatError(path, f"has no tensor {shown(key)}")
        return handle, entry

    def raw(self, path: str, key: str, start: int, stop: int, slot: str | None = None) -> np.ndarray:
        """Elements [start, stop) of the flattened tensor in its storage dtype (dtypes.STORAGE: bf16
        and float8 as unsigned integers). With `slot`, into a buffer reused by the next read of
        that slot; without, a new array."""
        handle, entry = self._entry(path, key)
        numel = math.prod(entry.shape)
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"range [{start}, {stop}) is outside tensor {key!r} of {numel} elements")
        storage = STORAGE.get(entry.dtype)
        if storage is None:
            raise DumpFormatError(path, f"tensor {shown(key)} is {entry.dtype}, not a floating-point dtype")
        offset, num_bytes = entry.begin + start * storage.itemsize, (stop - start) * storage.itemsize
        if slot is None:
            buffer = np.empty(num_bytes, dtype=np.uint8)
        else:
            buffer = self._scratch.get(slot, np.empty(0, dtype=np.uint8))
            if buffer.size < num_bytes:
                buffer = self._scratch[slot] = np.empty(num_bytes, dtype=np.uint8)
            buffer = buffer[:num_bytes]
        view = memoryview(buffer)  # type: ignore[arg-type]
        done = 0
        try:
            handle.seek(offset)
            while done < num_bytes:
                got = handle.readinto(view[done:])  # type: ignore[attr-defined]
                if not got:
                    raise DumpFormatError(
                        path,
                        f"tensor {shown(key)} is cut short at byte {offset + done}",
                        "the file was truncated or rewritten after it was checked",
                    )
                done += got
        except OSError as exc:
            raise DumpFormatError(path, os_problem(exc)) from None
        return buffer.view(storage)

    def float64(self, path: str, key: str, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) as a new float64 array."""
        from .dtypes import widen

        entry = self.entry(path, key)
        with np.errstate(invalid="ignore"):
            return widen(self.raw(path, key, start, stop), entry.dtype)

    def read(self, path: str, key: str) -> torch.Tensor:
        """The whole tensor as a torch tensor of its dumped dtype and shape (imports torch)."""
        import torch

        entry = self.entry(path, key)
        raw = self.raw(path, key, 0, math.prod(entry.shape))
        dtype = getattr(torch, entry.dtype)
        if raw.size == 0:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.from_numpy(raw.view(np.uint8).copy()).view(dtype).reshape(entry.shape)

    def close(self) -> None:
        for handle in self._open_files.values():
            handle.close()
        self._open_files.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
