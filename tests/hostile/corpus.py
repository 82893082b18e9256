"""Builders for broken dumps: a valid step folder, and the tools to break it in one precise way."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradaudit.capture.build import box, whole, write_rank
from gradaudit.model import ClipRecord, DataRecord, Topology

WORLD_SIZE = 2
STEP = 7
MAX_NORM = 1.0


def write_valid_step(
    step_dir: Path, *, names: tuple[str, str] = ("w", "b"), run_id: str = "run-a", stats_only: bool = False
) -> Path:
    """A clean two-rank step: `w` (4x3) sharded by rows, `b` (3,) replicated over dp; the clip record
    matches the true norm, so `gradaudit check` finds nothing. `stats_only` stores statistics, not values."""
    w_name, b_name = names
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=generator)
    b = torch.randn(3, generator=generator)
    norm = math.sqrt(float(w.double().pow(2).sum() + b.double().pow(2).sum()))
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    topology = Topology(groups={"dp": ((0, 1),)}, norm_group="dp")
    for rank in range(WORLD_SIZE):
        rows = w[2 * rank : 2 * rank + 2]
        write_rank(
            step_dir,
            rank=rank,
            world_size=WORLD_SIZE,
            step=STEP,
            params={w_name: (4, 3), b_name: (3,)},
            pieces=[
                box(w_name, (2 * rank, 0), grad=rows, grad_clipped=rows * coef, stats_only=stats_only),
                whole(b_name, grad=b, grad_clipped=b * coef, replica_group="dp", stats_only=stats_only),
            ],
            clip=ClipRecord(max_norm=MAX_NORM, reported_norm=norm, clip_coef=coef),
            topology=topology,
            data=DataRecord(tokens=64, loss=2.0, loss_reduction="mean"),
            run_id=run_id,
            host="host-a",
            created_at="2026-01-01T00:00:00+00:00",
            columnar=False,  # the corpus edits the JSON piece list
        )
    return step_dir


def rank_path(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank:05d}.safetensors"


# ------------------------------------------------------------------ editing a file's header


@dataclass
class Parts:
    """A safetensors file taken apart: its header as JSON and its data section as bytes."""

    header: dict
    data: bytes

    @property
    def metadata(self) -> dict:
        return json.loads(self.header["__metadata__"]["gradaudit"])

    @metadata.setter
    def metadata(self, doc: Any) -> None:
        self.header["__metadata__"]["gradaudit"] = json.dumps(doc)


def read_parts(path: Path) -> Parts:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return Parts(header=json.loads(raw[8 : 8 + length]), data=raw[8 + length :])


def header_bytes(path: Path) -> tuple[bytes, bytes]:
    """(the header's JSON bytes, the data section) of a file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + length], raw[8 + length :]


def write_header_bytes(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def write_parts(path: Path, parts: Parts) -> None:
    write_header_bytes(path, json.dumps(parts.header).encode(), parts.data)


def edit_metadata(path: Path, edit: Callable[[dict], Any]) -> None:
    """Apply `edit` to the gradaudit metadata document of a file (it may mutate, or return a new one)."""
    parts = read_parts(path)
    doc = parts.metadata
    result = edit(doc)
    parts.metadata = doc if result is None else result
    write_parts(path, parts)


def edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    parts = read_parts(path)
    edit(parts.header)
    write_parts(path, parts)


def deeply_nested(depth: int) -> str:
    """Lists in lists, spaced out so that the JSON is no denser than a real dump (one list per 16 bytes)."""
    return ("[" + " " * 15) * depth + "]" * depth


# ------------------------------------------------------------------ the corpus


@dataclass(frozen=True)
class Case:
    """One broken input and the answer expected from every command that reads it."""

    name: str
    build: Callable[[Path], tuple[Path, str]]
    """Builds the input under a fresh folder; returns (the path to give the CLI, the name the
    message must contain)."""
    problem: str
    """A regular expression the stderr line must match (after `error: <path>: `)."""
    exit_codes: dict[str, int] | None = None
    """Exit code by command when not 2 (the finding cases)."""


def _valid(root: Path) -> Path:
    return write_valid_step(root / f"step_{STEP}")


def _break_rank1(edit: Callable[[Path], None]) -> Callable[[Path], tuple[Path, str]]:
    def build(root: Path) -> tuple[Path, str]:
        step_dir = _valid(root)
        target = rank_path(step_dir, 1)
        edit(target)
        return step_dir, target.name

    return build


def _metadata(edit: Callable[[dict], Any]) -> Callable[[Path], tuple[Path, str]]:
    return _break_rank1(lambda path: edit_metadata(path, edit))


def _header(edit: Callable[[dict], None]) -> Callable[[Path], tuple[Path, str]]:
    return _break_rank1(lambda path: edit_header(path, edit))


def _raw_header(header: bytes) -> Callable[[Path], tuple[Path, str]]:
    return _break_rank1(lambda path: write_header_bytes(path, header, header_bytes(path)[1]))


def _truncate(keep: Callable[[int], int]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        os.truncate(path, keep(path.stat().st_size))

    return edit


def _set_length(length: int) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", length) + raw[8:])

    return edit


def _empty_folder(root: Path) -> tuple[Path, str]:
    folder = root / "step_7"
    folder.mkdir()
    return folder, str(folder)


def _not_a_folder(root: Path) -> tuple[Path, str]:
    path = root / "notes.txt"
    path.write_text("hello\n")
    return path, str(path)


def _no_such_path(root: Path) -> tuple[Path, str]:
    return root / "step_404", "step_404"


def _checkpoint(metadata: dict | None) -> Callable[[Path], tuple[Path, str]]:
    def build(root: Path) -> tuple[Path, str]:
        from safetensors.torch import save_file

        step_dir = _valid(root)
        target = rank_path(step_dir, 1)
        target.unlink()
        tensors = {
            "layer.weight": torch.randn(4, 4),
            "bn.num_batches_tracked": torch.tensor(3, dtype=torch.int64),
        }
        save_file(tensors, str(target), metadata=metadata)
        return step_dir, target.name

    return build


def _duplicate_rank(root: Path) -> tuple[Path, str]:
    step_dir = _valid(root)
    shutil.copyfile(rank_path(step_dir, 0), rank_path(step_dir, 1))
    return step_dir, rank_path(step_dir, 1).name


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda doc: doc.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict], None]:
    def edit(doc: dict) -> None:
        del doc[key]

    return edit


def _set_clip(key: str, value: Any) -> Callable[[dict], None]:
    return lambda doc: doc["clip"].__setitem__(key, value)


def _box_outside(doc: dict) -> None:
    doc["pieces"][0]["regions"][0]["box"]["offsets"] = [3, 0]


def _shape_disagrees(doc: dict) -> None:
    doc["pieces"][0]["local_shape"] = [3, 2]


def _tensor_missing(doc: dict) -> None:
    doc["pieces"][0]["tensors"]["grad"] = "no-such-tensor"


def _claims_1e15_in_metadata(doc: dict) -> None:
    doc["params"].append({"name": "huge", "global_shape": [10**15], "dtype": "float32"})
    piece = doc["pieces"][0]
    piece.update(param="huge", regions=[{"range": [0, 10**15]}], local_shape=[10**15])


def _claims_1e15_in_header(header: dict) -> None:
    header["w::grad::0"]["shape"] = [10**15]


def _claims_too_many_elements(doc: dict) -> None:
    doc["params"][0]["global_shape"] = [10**10, 10**10]


def _mixed_step(path: Path) -> None:
    edit_metadata(path, _set("step", STEP + 1))


def _stray_file(root: Path) -> tuple[Path, str]:
    step_dir = _valid(root)
    (step_dir / "notes.txt").write_text("copied from the bucket\n")
    return step_dir, "notes.txt"


def _missing_rank(root: Path) -> tuple[Path, str]:
    step_dir = _valid(root)
    rank_path(step_dir, 1).unlink()
    return step_dir, "1"


def _rank_link_loop(root: Path) -> tuple[Path, str]:
    step_dir = _valid(root)
    target = rank_path(step_dir, 1)
    target.unlink()
    target.symlink_to(target.name)
    return step_dir, target.name


def _broken_link(root: Path) -> tuple[Path, str]:
    step_dir = _valid(root)
    target = rank_path(step_dir, 1)
    target.unlink()
    target.symlink_to("gone.safetensors")
    return step_dir, target.name


def _step_dir_link_loop(root: Path) -> tuple[Path, str]:
    link = root / "step_7"
    link.symlink_to("step_7")
    return link, str(link)


def _rank_is_a_folder(root: Path) -> tuple[Path, str]:
    step_dir = _valid(root)
    target = rank_path(step_dir, 1)
    target.unlink()
    target.mkdir()
    return step_dir, target.name


def _rank_is_a_pipe(root: Path) -> tuple[Path, str]:
    step_dir = _valid(root)
    target = rank_path(step_dir, 1)
    target.unlink()
    os.mkfifo(target)
    return step_dir, target.name


def _stats_only_1e15(root: Path) -> tuple[Path, str]:
    """A valid stats-only piece claiming 10^15 elements: audited from its statistics, nothing allocated."""
    step_dir = _valid(root)

    def edit(doc: dict) -> None:
        doc["params"].append({"name": "huge", "global_shape": [10**15], "dtype": "float32"})
        doc["pieces"].append(
            {
                "param": "huge",
                "regions": [{"range": [0, 10**15]}],
                "local_shape": [10**15],
                "dtype": "float32",
                "replica_group": "dp",
                "stats": {
                    "grad": {"numel": 10**15, "norm_type": 2.0, "sum_pow": 0.0, "sum_sq": 0.0, "max_abs": 0.0}
                },
            }
        )

    for rank in range(WORLD_SIZE):
        edit_metadata(rank_path(step_dir, rank), edit)
    return step_dir, "huge"


REPORT = {"show": 0, "check": 0}
"""A clean report from both commands."""

CORPUS: tuple[Case, ...] = (
    Case(
        "an empty folder",
        _empty_folder,
        r"holds no rank files \(\*\.safetensors\); is this a step_<N> dump folder\?$",
    ),
    Case(
        "a path that is a file, not a folder",
        _not_a_folder,
        r"is a file, not a folder; point gradaudit at the step_<N> folder",
    ),
    Case(
        "a path that does not exist",
        _no_such_path,
        r"no such folder; point gradaudit at a step_<N> dump folder$",
    ),
    Case(
        "an empty file",
        _break_rank1(_truncate(lambda n: 0)),
        r"is 0 bytes long, too short to be a safetensors file$",
    ),
    Case("a file of three bytes", _break_rank1(_truncate(lambda n: 3)), r"is 3 bytes long, too short"),
    Case(
        "a file truncated in the header",
        _break_rank1(_truncate(lambda n: 40)),
        r"header claims \d+ bytes but the file has only 32 after it \(the file is truncated\)$",
    ),
    Case(
        "a file truncated in the data",
        _break_rank1(_truncate(lambda n: n - 5)),
        r"tensor '.*' ends at byte \d+ of a \d+-byte data section \(the file is truncated\)$",
    ),
    Case(
        "a header length larger than the file",
        _break_rank1(_set_length(2**40)),
        r"header claims 1099511627776 bytes but the file has only \d+ after it \(the file is truncated\)$",
    ),
    Case(
        "a header length of 2^64-1",
        _break_rank1(_set_length(2**64 - 1)),
        r"header claims 18446744073709551615 bytes",
    ),
    Case(
        "a header length of zero", _break_rank1(_set_length(0)), r"header is not valid JSON \(Expecting value"
    ),
    Case(
        "header JSON that is invalid",
        _raw_header(b'{"__metadata__": {"gradaudit": '),
        r"header is not valid JSON \(",
    ),
    Case(
        "header JSON that is not an object",
        _raw_header(b"[1, 2, 3]"),
        r"header is not a JSON object \(the file is not a safetensors file\)$",
    ),
    Case("header bytes that are not UTF-8", _raw_header(b'{"\xff\xfe": 1}'), r"header is not UTF-8 text"),
    Case(
        "header JSON with a duplicate key",
        _raw_header(b'{"a": 1, "a": 2}'),
        r"header is not valid JSON \(duplicate key 'a'\)",
    ),
    Case(
        "header JSON nested 100000 deep",
        _raw_header(deeply_nested(100_000).encode()),
        r"header is not valid JSON \(maximum recursion depth",
    ),
    Case(
        "header __metadata__ that is not a map of strings",
        _header(lambda h: h.__setitem__("__metadata__", {"gradaudit": 1})),
        r"header __metadata__ is not a map of strings$",
    ),
    Case(
        "a tensor of an unknown dtype",
        _header(lambda h: h["w::grad::0"].__setitem__("dtype", "F4")),
        r"tensor 'w::grad::0' has dtype 'F4', which gradaudit cannot read$",
    ),
    Case(
        "a model checkpoint without gradaudit metadata",
        _checkpoint(None),
        r"is a safetensors file without gradaudit metadata \(is it a model checkpoint\? point gradaudit at a step_<N> dump folder\)$",
    ),
    Case(
        "a Hugging Face checkpoint with its own metadata",
        _checkpoint({"format": "pt"}),
        r"is a safetensors file without gradaudit metadata",
    ),
    Case(
        "metadata that is not JSON",
        _header(lambda h: h["__metadata__"].__setitem__("gradaudit", "{")),
        r"gradaudit metadata is not valid JSON \(",
    ),
    Case(
        "metadata with a NaN token",
        _header(lambda h: h["__metadata__"].__setitem__("gradaudit", '{"step": NaN}')),
        r"gradaudit metadata is not valid JSON \(JSON constant NaN is not allowed\)",
    ),
    Case(
        "metadata nested 100000 deep",
        _header(lambda h: h["__metadata__"].__setitem__("gradaudit", deeply_nested(100_000))),
        r"gradaudit metadata is not valid JSON \(maximum recursion depth",
    ),
    Case(
        "metadata that is a list",
        _metadata(lambda doc: [doc]),
        r"metadata field \(root\): expected an object, got a list",
    ),
    Case(
        "metadata without the format marker",
        _metadata(_set("format", "other")),
        r"is not a gradaudit dump \(no gradaudit format marker\)",
    ),
    Case(
        "metadata missing world_size",
        _metadata(_drop("world_size")),
        r"metadata field world_size: missing \(the file is not a valid gradaudit dump\)$",
    ),
    Case("metadata missing the pieces", _metadata(_drop("pieces")), r"metadata field pieces: missing"),
    Case(
        "metadata with a step that is a string",
        _metadata(_set("step", "7")),
        r"metadata field step: expected an integer, got a string",
    ),
    Case(
        "metadata with a rank that is a boolean",
        _metadata(_set("rank", True)),
        r"metadata field rank: expected an integer, got a boolean",
    ),
    Case(
        "metadata with pieces that are an object",
        _metadata(_set("pieces", {})),
        r"metadata field pieces: expected a list, got an object",
    ),
    Case(
        "metadata with max_norm nan",
        _metadata(_set_clip("max_norm", "nan")),
        r"metadata field clip.max_norm: must be a positive number, got 'nan'",
    ),
    Case(
        "metadata with max_norm inf",
        _metadata(_set_clip("max_norm", "inf")),
        r"metadata field clip.max_norm: must be finite",
    ),
    Case(
        "metadata with a negative max_norm",
        _metadata(_set_clip("max_norm", -1.0)),
        r"metadata field clip.max_norm: must be a positive number, got -1.0",
    ),
    Case(
        "metadata with a 400-digit max_norm",
        _metadata(_set_clip("max_norm", 10**400)),
        r"metadata field clip.max_norm: is a number too large for a float64",
    ),
    Case(
        "metadata with a negative step",
        _metadata(_set("step", -1)),
        r"metadata field step: must be >= 0, got -1",
    ),
    Case(
        "metadata with world_size zero",
        _metadata(_set("world_size", 0)),
        r"metadata field world_size: must be >= 1, got 0",
    ),
    Case(
        "metadata with world_size 10^12",
        _metadata(_set("world_size", 10**12)),
        r"metadata field world_size: must be <= 1048576",
    ),
    Case(
        "metadata with a negative stat",
        _metadata(
            lambda doc: doc["pieces"][0].__setitem__(
                "stats",
                {"grad": {"numel": 6, "norm_type": 2.0, "sum_pow": -1.0, "sum_sq": 1.0, "max_abs": 1.0}},
            )
        ),
        r"metadata field pieces\[0\]\.stats\.grad\.sum_pow: must be a non-negative number",
    ),
    Case(
        "an unknown major format version",
        _metadata(_set("format_version", "2.0")),
        r"uses dump format 2\.0, newer than the 1\.\d+ this gradaudit reads \(upgrade gradaudit",
    ),
    Case(
        "an unreadable format version",
        _metadata(_set("format_version", "²")),
        r"has an unreadable format_version '²' \(expected MAJOR.MINOR\)$",
    ),
    Case(
        "a piece whose box lies outside its parameter",
        _metadata(_box_outside),
        r"metadata field pieces\[0\]\.regions\[0\]: box offsets \[3, 0\] shape \[2, 3\] lies outside parameter 'w' of shape \[4, 3\]",
    ),
    Case(
        "a piece whose shape disagrees with its tensor",
        _metadata(_shape_disagrees),
        r"tensor 'w::grad::0' has shape \[2, 3\] but its piece says \[3, 2\]$",
    ),
    Case(
        "a piece naming a tensor the file lacks",
        _metadata(_tensor_missing),
        r"piece 0 \('w'\) names tensor 'no-such-tensor', which the file lacks$",
    ),
    Case(
        "two files claiming the same rank",
        _duplicate_rank,
        r"claims rank 0, as does rank_00000\.safetensors \(remove the stray copy\)$",
    ),
    Case(
        "a rank outside the world size",
        _metadata(_set("rank", 5)),
        r"metadata field rank: rank 5 is outside world size 2",
    ),
    Case("a negative rank", _metadata(_set("rank", -1)), r"metadata field rank: must be >= 0, got -1"),
    Case(
        "a group naming a rank outside the world",
        _metadata(lambda doc: doc["topology"]["groups"].__setitem__("dp", [[0, 9]])),
        r"metadata field topology\.groups\.dp\[0\]: names a rank outside world size 2",
    ),
    Case(
        "ranks from different steps in one folder",
        _break_rank1(_mixed_step),
        rf"has step {STEP + 1} but rank_00000\.safetensors has step {STEP} \(a step folder must hold one step of one run; move the stray file out\)$",
    ),
    Case(
        "ranks from different runs in one folder",
        _metadata(_set("run_id", "run-b")),
        r"has run_id 'run-b' but rank_00000\.safetensors has run_id 'run-a'",
    ),
    Case(
        "ranks with different world sizes in one folder",
        _metadata(_set("world_size", 4)),
        r"has world_size 4 but rank_00000\.safetensors has world_size 2",
    ),
    Case(
        "a tensor header claiming 10^15 elements",
        _header(_claims_1e15_in_header),
        r"tensor 'w::grad::0' has shape \[1000000000000000\] but 24 bytes of data$",
    ),
    Case(
        "a piece claiming 10^15 elements beside a small tensor",
        _metadata(_claims_1e15_in_metadata),
        r"tensor 'w::grad::0' has shape \[2, 3\] but its piece says \[1000000000000000\]$",
    ),
    Case(
        "a parameter claiming 10^20 elements",
        _metadata(_claims_too_many_elements),
        r"metadata field params\[0\]\.global_shape: claims 100000000000000000000 elements, more than any real tensor",
    ),
    Case("a rank file that is a symlink to itself", _rank_link_loop, r"is a symbolic link loop$"),
    Case(
        "a rank file that is a broken symlink",
        _broken_link,
        r"does not exist \(a broken symbolic link, or removed while reading\)$",
    ),
    Case(
        "a step folder that is a symlink loop",
        _step_dir_link_loop,
        r"is a symbolic link loop; point gradaudit at the real step_<N> folder$",
    ),
    Case(
        "a rank file that is a folder",
        _rank_is_a_folder,
        r"is not a regular file \(a folder, pipe or device\)$",
    ),
    Case(
        "a rank file that is a named pipe",
        _rank_is_a_pipe,
        r"is not a regular file \(a folder, pipe or device\)$",
    ),
    # The finding cases: a report, not exit 2.
    Case("a missing rank", _missing_rank, r"", exit_codes={"show": 0, "check": 1}),
    Case("a stray file beside the dumps", _stray_file, r"", exit_codes=REPORT),
    Case("a stats-only piece claiming 10^15 elements", _stats_only_1e15, r"", exit_codes=REPORT),
)
