"""Dump files of format 1.1 and their 1.0 (JSON) form, made and edited for the dumpfile tests."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from builders import FIXED
from cli_runner import run_cli

from gradaudit.capture.build import box, flat, whole, write_rank
from gradaudit.dumpfile.dump import RankDump
from gradaudit.dumpfile.schema import METADATA_KEY, encode_rank
from gradaudit.model import ClipRecord


def stats_step(directory: Path, rank: int = 0, world_size: int = 2) -> Path:
    """A stats-only rank of three parameters (a box, a flat range, a replica) with a nan in its box."""
    gen = torch.Generator().manual_seed(rank)
    grad = torch.randn(6, 4, generator=gen)
    grad[0, 0] = math.nan
    return write_rank(
        directory,
        rank=rank,
        world_size=world_size,
        step=3,
        params={"layers.0.w": (12, 4), "emb": (10, 3), "norm": (5,)},
        pieces=[
            box("layers.0.w", (6 * rank, 0), grad=grad, stats_only=True),
            flat("emb", 15 * rank, grad=torch.randn(15, generator=gen), stats_only=True),
            whole("norm", grad=torch.randn(5, generator=gen), replica_group="dp", stats_only=True),
        ],
        clip=ClipRecord(max_norm=1.0, reported_norm=2.0),
        **FIXED,
    )


def header_of(path: Path) -> tuple[int, dict, dict]:
    """The header length, the safetensors header and the gradaudit document of a rank file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    return length, header, json.loads(header["__metadata__"][METADATA_KEY])


def write_json_1_0(directory: Path, dump: RankDump) -> None:
    """`dump` written as format 1.0 did: every piece in the JSON document, no columns."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    doc = dict(encode_rank(dump), format_version="1.0")
    save_file(
        {}, str(directory / f"rank_{dump.rank:05d}.safetensors"), metadata={METADATA_KEY: json.dumps(doc)}
    )


def rewrite_columns(path: Path, edit) -> None:
    """The rank file at `path` rewritten after `edit(arrays, doc)` changed its columns or document."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    _, _, doc = header_of(path)
    arrays = {k: v.copy() for k, v in load_file(str(path)).items()}
    edit(arrays, doc)
    save_file(
        {k: torch.from_numpy(v) for k, v in arrays.items()},
        str(path),
        metadata={METADATA_KEY: json.dumps(doc)},
    )


def json_reports(capsys: pytest.CaptureFixture[str], *folders: Path) -> list[dict]:
    """The JSON report of `gradaudit check` on each folder (exit 0 or 1), less what names the folder."""
    reports = []
    for folder in folders:
        outcome = run_cli(capsys, "check", folder, "--format", "json")
        assert outcome.code in (0, 1), outcome.stderr
        report = json.loads(outcome.stdout)
        report.pop("command"), report.pop("warnings")
        reports.append(report)
    return reports
