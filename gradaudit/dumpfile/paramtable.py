"""Format 1.1 shared parameter tables: one file per distinct table in a step folder, named by its hash.

Every rank of a step usually holds the same parameter table (names, global shapes, dtypes); written
into each rank file it was 64 KB a rank for 800 parameters, 40% of a 4096-rank stats dump. A rank
file may instead name a table file beside it, `params_<first 16 hex digits of its SHA-256>.safetensors`,
holding the three `__gradaudit__.params.*` columns: its "columnar" entry's "params" is then
{"file": <that name>, "sha256": <the file's SHA-256, 64 hex digits>} (see docs/FORMAT.md).

Writers create the file under a temporary name and link it into place only if the name is free; a
file already there must hold the same bytes, else the rank writes its table inline. The name comes
from the bytes, so ranks writing at once on a shared filesystem, and nodes with their own disks whose
folders are gathered later, all end with one file per distinct table.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DumpFormatError
from .columnar import DIMS, META, NAMES

TABLE_FILE = re.compile(r"^params_([0-9a-f]{16})\.safetensors$")
TABLE_METADATA_KEY = "gradaudit-params"
"""The table file's only `__metadata__` entry; its value is the format version, "1.1"."""
TABLE_COLUMNS = (NAMES, META, DIMS)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_table_file(name: str) -> bool:
    return TABLE_FILE.match(name) is not None


def table_file_bytes(columns: Mapping[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save({key: columns[key] for key in TABLE_COLUMNS}, metadata={TABLE_METADATA_KEY: "1.1"})


def _sha256(data: bytes) -> str:
    import hashlib  # a check of a step without shared tables never hashes

    return hashlib.sha256(data).hexdigest()


def table_reference(data: bytes) -> dict[str, str]:
    """The "params" entry of a rank file whose table is `data` (a table file's bytes)."""
    digest = _sha256(data)
    return {"file": f"params_{digest[:16]}.safetensors", "sha256": digest}


def publish_table(directory: Path, name: str, data: bytes, temporary: Path) -> bool:
    """Make `directory/name` hold `data` without replacing any file: True when it then does (created
    here or found with the same bytes), False when another file holds the name or it cannot be written."""
    final = directory / name
    found = _holds(final, data)
    if found is not None:
        return found
    try:
        fd = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except OSError:
        return False  # nothing created here, so nothing to remove: never another writer's file
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        try:
            os.link(temporary, final)
            return True
        except FileExistsError:
            pass
        except OSError:
            return _create_exclusively(final, data)
        return _holds(final, data) is True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _create_exclusively(final: Path, data: bytes) -> bool:
    """For filesystems without hard links: write under the final name, which must not exist yet."""
    try:
        fd = os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        return _holds(final, data) is True
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    return True


def _holds(path: Path, data: bytes) -> bool | None:
    """Whether `path` holds exactly `data`; None when there is no such file.

    Opened non-blocking and checked to be a regular file before anything is read: the name is
    predictable (the table's hash), and a blocking open of a FIFO placed there would stop training."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            from ..warn import warn_once

            warn_once(
                f"table-not-a-file:{path}",
                f"gradaudit: {path} is not a regular file (a pipe, device or folder); the parameter "
                "table is written into each rank file instead. Remove it from the dump folder",
            )
            return False
        with os.fdopen(fd, "rb") as handle:
            fd = -1
            return handle.read(len(data) + 1) == data
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


class SharedTables:
    """The table files one load reads: each is read and hash-checked once, however many ranks name it."""

    def __init__(self) -> None:
        self._read: dict[str, tuple[str, dict[str, Any]] | tuple[str, str]] = {}
        self.referenced: set[str] = set()

    def columns(self, reference: Any, rank_path: str) -> dict[str, Any]:
        """The table columns `reference` (a rank file's "params" entry) names, from the rank file's folder."""
        if not (
            isinstance(reference, dict)
            and isinstance(reference.get("file"), str)
            and isinstance(reference.get("sha256"), str)
            and (named := TABLE_FILE.match(reference["file"])) is not None
            and _SHA256.match(reference["sha256"])
            and reference["sha256"].startswith(named.group(1))
        ):
            raise DumpFormatError(
                rank_path,
                "columnar params: not 'columns', 'json' or a shared table "
                '{"file": "params_<16 hex>.safetensors", "sha256": <its 64 hex digits>}',
                "the file is not a valid gradaudit dump",
            )
        table_path = os.path.join(os.path.dirname(rank_path), reference["file"])
        self.referenced.add(reference["file"])
        if table_path not in self._read:
            self._read[table_path] = _read_table(table_path)
        digest, found = self._read[table_path]
        if isinstance(found, str):
            raise DumpFormatError(
                rank_path, f"its parameter table {table_path} {found}", _hint(reference["file"])
            )
        if digest != reference["sha256"]:
            raise DumpFormatError(
                rank_path,
                f"its parameter table {table_path} does not have the SHA-256 the rank file names (it was changed or replaced)",
                _hint(reference["file"]),
            )
        return found


def _hint(name: str) -> str:
    return f"copy {name} from the folder the ranks wrote into, beside this rank file"


def _read_table(path: str) -> tuple[str, dict[str, Any]] | tuple[str, str]:
    """(SHA-256 of the file, its columns), or ("", what is wrong with it)."""
    from .header import (
        open_regular_file,
        os_problem,
        read_columns,
        read_exactly,
        read_raw_header_from,
        validate_tensors,
    )

    try:
        handle = open_regular_file(path)
    except DumpFormatError as exc:
        missing = not os.path.lexists(path)
        return "", "is missing" if missing else f"cannot be read ({exc.problem})"
    try:
        with handle:
            raw = read_raw_header_from(handle, path)
            if TABLE_METADATA_KEY not in raw.metadata:
                return "", f"is not a gradaudit parameter table (no {TABLE_METADATA_KEY!r} metadata)"
            header = validate_tensors(raw)
            if set(header.tensors) != set(TABLE_COLUMNS):
                return "", "does not hold exactly the three __gradaudit__.params.* columns"
            columns = read_columns(handle, path, header)
            handle.seek(0)
            digest = _sha256(read_exactly(handle, header.file_size))
    except DumpFormatError as exc:
        return "", f"is corrupt ({exc.problem})"
    except OSError as exc:
        return "", f"cannot be read ({os_problem(exc)})"
    return digest, columns


def resolve_shared(
    doc: dict[str, Any], arrays: dict[str, Any], path: str, tables: SharedTables
) -> dict[str, Any]:
    """A rank file's columns with the shared table's added, and its document's "params" entry set to
    "columns", as if the table had been written inline."""
    if any(key in arrays for key in TABLE_COLUMNS):
        raise DumpFormatError(
            path,
            "columnar params: names a shared table but also holds __gradaudit__.params.* columns",
            "the file is not a valid gradaudit dump",
        )
    found = tables.columns(doc["columnar"]["params"], path)
    doc["columnar"] = {**doc["columnar"], "params": "columns"}
    return {**arrays, **found}


def unreferenced_tables(directory: Path, tables: SharedTables) -> list[str]:
    """Warnings for table files in `directory` that no rank file of the load named."""
    try:
        names = sorted(e.name for e in os.scandir(directory) if is_table_file(e.name))
    except OSError:
        return []
    return [
        f"{directory / name}: ignored, a parameter table that no rank file names"
        for name in names
        if name not in tables.referenced
    ]
