"""Format-1.1 columns whose sums wrap around in int64 are refused like their JSON form:
exit code 2 and one line naming the rank file, from `check` and `show`."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.numpy import load_file, save

from gradaudit.capture.build import box, flat, write_rank
from gradaudit.dumpfile.columnar import COORDS, META, PIECES, counts_key
from gradaudit.dumpfile.schema import METADATA_KEY
from gradaudit.model import ClipRecord

from .cli import assert_clean_refusal, run_cli

BIG = 2**62


def _columnar_rank(step_dir):
    gen = torch.Generator().manual_seed(0)
    return write_rank(
        step_dir,
        rank=0,
        world_size=1,
        step=3,
        params={"w": (100,), "m": (10, 10), "f": (50,)},
        pieces=[
            box("w", (0,), grad=torch.randn(100, generator=gen), stats_only=True),
            box("m", (0, 0), grad=torch.randn(10, 10, generator=gen), stats_only=True),
            flat("f", 0, grad=torch.randn(50, generator=gen), stats_only=True),
        ],
        clip=ClipRecord(max_norm=1.0),
        share_params=False,
    )


def _rewrite(path, edit) -> None:
    """The rank file with its columns edited by `edit(arrays, first)`, `first[i]` being piece i's
    first coordinate; written byte for byte as the writer lays a file out."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    metadata = json.loads(raw[8 : 8 + length])["__metadata__"]
    arrays = {k: v.copy() for k, v in load_file(str(path)).items()}
    edit(arrays, arrays[PIECES][:, 2].tolist())
    path.write_bytes(save(arrays, metadata=metadata))
    assert METADATA_KEY in metadata


def _set_box(index: int, values: list[int]):
    def edit(arrays, first):
        arrays[COORDS][first[index] : first[index] + len(values)] = values

    return edit


def _set_counts(index: int):
    def edit(arrays, first):
        arrays[counts_key("grad")][index] = [BIG, BIG, BIG]

    return edit


def _wrapping_name_offsets(arrays, first):
    meta = arrays[META]
    meta[0, 0] = 2**63 - 1  # the difference with the next, negative, offset wraps to a positive one
    meta[1, 0] = -(2**62)


CASES = {
    "1-D box offsets [2^62] shape [2^62]": (
        _set_box(0, [BIG, BIG]),
        r"piece 0: box \[4611686018427387904\] \+ \[4611686018427387904\] is outside 'w'",
    ),
    "2-D box offsets [2^62, 0] shape [2^62, 2]": (
        _set_box(1, [BIG, 0, BIG, 2]),
        r"piece 1: box \[4611686018427387904, 0\] \+ \[4611686018427387904, 2\] is outside 'm'",
    ),
    "count rows of 2^62, range": (_set_counts(2), "piece 2: more nonfinite grad values than elements"),
    "count rows of 2^62, box": (_set_counts(0), "piece 0: more nonfinite values than elements"),
    "name offsets that wrap": (_wrapping_name_offsets, "name offsets do not cover the names"),
}


@pytest.mark.parametrize("command", ["check", "show"])
@pytest.mark.parametrize("case", list(CASES))
def test_columns_whose_int64_sums_wrap_are_refused_naming_the_rank_file(tmp_path, capsys, case, command):
    edit, problem = CASES[case]
    path = _columnar_rank(tmp_path / "step_3")
    _rewrite(path, edit)
    outcome = run_cli(capsys, command, str(path.parent))
    assert_clean_refusal(outcome, names=path.name, problem=problem)
