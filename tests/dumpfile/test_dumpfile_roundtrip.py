import json
import math

import pytest
import torch
from builders import write_one_rank

from gradaudit.capture.build import box, flat, whole, write_rank
from gradaudit.dumpfile import TensorReader, load_step
from gradaudit.dumpfile.header import read_header
from gradaudit.errors import DumpFormatError
from gradaudit.model import ClipCall, ClipRecord, DataRecord, FlatRange, MeshInfo, Topology
from gradaudit.version import __version__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_then_load_gives_back_the_same_tensors_bit_for_bit(tmp_path, dtype):
    torch.manual_seed(0)
    g0 = torch.randn(2, 3).to(dtype)
    g1 = torch.randn(2, 3).to(dtype)
    clipped = (g0 * 0.5).to(dtype)
    for rank, g in ((0, g0), (1, g1)):
        write_rank(
            tmp_path,
            rank=rank,
            world_size=2,
            step=5,
            params={"w": (4, 3)},
            pieces=[box("w", (2 * rank, 0), grad=g, grad_clipped=clipped)],
            clip=ClipRecord(max_norm=1.0, reported_norm=0.75, clip_coef=0.5),
        )
    step = load_step(tmp_path)
    assert step.ranks_present == (0, 1) and step.missing_ranks == ()
    with TensorReader() as reader:
        for rank, g in ((0, g0), (1, g1)):
            piece = step.ranks[rank].pieces[0]
            got = reader.read(step.ranks[rank].path, piece.tensors["grad"])
            assert got.dtype == dtype
            assert torch.equal(
                got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                g.view(torch.int16 if dtype != torch.float32 else torch.int32),
            )
            assert torch.equal(reader.read(step.ranks[rank].path, piece.tensors["grad_clipped"]), clipped)


def test_metadata_round_trips_including_nonfinite_numbers(tmp_path):
    topo = Topology(
        groups={"dp_shard": ((0, 1),), "dp_replicate": ((0,), (1,))},
        mesh=MeshInfo(shape=(1, 2), axis_names=("dp_replicate", "dp_shard"), ranks=(0, 1)),
        norm_group="dp_shard",
    )
    clip = ClipRecord(
        max_norm=1.0,
        norm_type=math.inf,
        reported_norm=math.nan,
        clip_coef=1.0,
        calls=(ClipCall(reported_norm=math.inf, unscaled=False, loss_scale=1024.0),),
        loss_scale=1024.0,
        unscaled_before_clip=False,
        found_inf=True,
        step_skipped=True,
    )
    write_rank(
        tmp_path,
        rank=1,
        world_size=2,
        step=9,
        params={"w": (8,)},
        pieces=[flat("w", 4, grad=torch.ones(4), replica_group="dp_replicate")],
        clip=clip,
        topology=topo,
        data=DataRecord(tokens=123, loss=2.5, loss_reduction="mean"),
        aliases={"head.w": "w"},
        run_id="run-1",
    )
    step = load_step(tmp_path)
    dump = step.ranks[1]
    assert step.missing_ranks == (0,)
    assert dump.topology == topo
    assert dump.clip.norm_type == math.inf and math.isnan(dump.clip.reported_norm)
    assert dump.clip.calls[0].reported_norm == math.inf and dump.clip.calls[0].loss_scale == 1024.0
    assert (dump.clip.found_inf, dump.clip.step_skipped, dump.clip.unscaled_before_clip) == (
        True,
        True,
        False,
    )
    assert dump.data == DataRecord(tokens=123, loss=2.5, loss_reduction="mean")
    assert dump.aliases == {"head.w": "w"}
    assert dump.pieces[0].regions == (FlatRange(start=4, stop=8),)
    assert dump.pieces[0].replica_group == "dp_replicate"


def test_stats_only_piece_stores_statistics_and_no_values(tmp_path):
    write_one_rank(
        tmp_path,
        params={"w": (2,)},
        pieces=[whole("w", grad=torch.tensor([3.0, float("nan")]), stats_only=True)],
    )
    step = load_step(tmp_path)
    piece = step.ranks[0].pieces[0]
    assert piece.tensors == {}
    assert step.ranks[0].mode == "stats"
    assert piece.stats["grad"].sum_sq == 9.0 and piece.stats["grad"].num_nan == 1
    assert all(key.startswith("__gradaudit__.") for key in read_header(step.ranks[0].path).tensors)


def test_on_disk_header_of_a_tiny_dump_is_pinned(tmp_path):
    write_rank(
        tmp_path,
        rank=0,
        world_size=2,
        step=3,
        params={"w": (2, 2)},
        pieces=[box("w", (0, 0), grad=torch.tensor([[1.0, 2.0]]))],
        clip=ClipRecord(max_norm=1.0, reported_norm=2.0),
        host="host-a",
        created_at="2026-01-01T00:00:00+00:00",
        run_id="r",
    )
    header = read_header(str(tmp_path / "rank_00000.safetensors"))
    doc = json.loads(header.metadata["gradaudit"])
    doc["torch_version"] = "<torch>"
    expected = {
        "aliases": {},
        "clip": {
            "calls": [],
            "clip_coef": None,
            "found_inf": None,
            "loss_scale": None,
            "max_norm": 1.0,
            "norm_type": 2.0,
            "reported_norm": 2.0,
            "step_skipped": None,
            "unscaled_before_clip": None,
        },
        "created_at": "2026-01-01T00:00:00+00:00",
        "data": {"loss": None, "loss_reduction": None, "tokens": None},
        "format": "gradaudit-dump",
        "format_version": "1.1",
        "gradaudit_version": __version__,
        "host": "host-a",
        "mode": "full",
        "params": [{"dtype": "float32", "global_shape": [2, 2], "name": "w"}],
        "pieces": [
            {
                "dtype": "float32",
                "local_shape": [1, 2],
                "param": "w",
                "regions": [{"box": {"offsets": [0, 0], "shape": [1, 2]}}],
                "tensors": {"grad": "w::grad::0"},
            }
        ],
        "rank": 0,
        "run_id": "r",
        "step": 3,
        "topology": {"groups": {}, "mesh": None, "norm_group": None},
        "torch_version": "<torch>",
        "world_size": 2,
    }
    assert doc == expected
    assert {k: (v.dtype, v.shape) for k, v in header.tensors.items()} == {"w::grad::0": ("float32", (1, 2))}


def test_a_dump_is_never_overwritten_silently(tmp_path):
    kwargs = {"rank": 0, "world_size": 1, "step": 1, "params": {"w": (1,)}, "clip": ClipRecord(max_norm=1.0)}
    path = write_rank(tmp_path, pieces=[whole("w", grad=torch.ones(1))], **kwargs)
    before = path.read_bytes()
    from gradaudit.dumpfile import DumpExistsError

    with pytest.raises(DumpExistsError, match="already exists"):
        write_rank(tmp_path, pieces=[whole("w", grad=torch.zeros(1))], **kwargs)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_00000.safetensors"]


def test_a_file_whose_box_lies_outside_its_parameter_is_refused_naming_the_file(tmp_path):
    path = write_one_rank(
        tmp_path,
        params={"w": (2, 2)},
        pieces=[box("w", (0, 0), grad=torch.ones(2, 2))],
    )
    raw = path.read_bytes()
    patched = raw.replace(b'\\"offsets\\": [0, 0]', b'\\"offsets\\": [1, 0]')
    assert patched != raw
    path.write_bytes(patched)
    with pytest.raises(DumpFormatError, match=r"rank_00000.safetensors: .*outside parameter 'w'"):
        load_step(tmp_path)


def test_a_newer_major_format_version_is_refused_with_an_upgrade_hint(tmp_path):
    path = write_one_rank(
        tmp_path,
        params={"w": (1,)},
        pieces=[whole("w", grad=torch.ones(1))],
    )
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'\\"format_version\\": \\"1.1\\"', b'\\"format_version\\": \\"2.0\\"'))
    with pytest.raises(DumpFormatError, match="newer than the 1.1 this gradaudit reads.*upgrade"):
        load_step(tmp_path)


def test_unknown_keys_from_a_newer_minor_version_are_ignored(tmp_path):
    path = write_one_rank(
        tmp_path,
        params={"w": (1,)},
        pieces=[whole("w", grad=torch.ones(1))],
    )
    raw = path.read_bytes()
    path.write_bytes(
        raw.replace(b'\\"format_version\\": \\"1.0\\"', b'\\"format_version\\": \\"1.7\\", \\"future\\": 1')
    )
    # the header length changed: rewrite it properly
    import struct

    n = struct.unpack("<Q", raw[:8])[0]
    body = raw[8 : 8 + n].replace(
        b'\\"format_version\\": \\"1.0\\"', b'\\"format_version\\": \\"1.7\\", \\"future\\": 1'
    )
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    assert load_step(tmp_path).ranks[0].pieces[0].param == "w"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rank_files_gradaudit_writes_itself_read_back_with_the_safetensors_library(tmp_path, dtype):
    from safetensors import safe_open

    from gradaudit.dumpfile.writer import write_safetensors

    tensors = {
        "b": torch.arange(6, dtype=dtype).reshape(2, 3),
        "a": torch.ones((), dtype=dtype),
        "e": torch.ones(0),
    }
    with open(tmp_path / "x.safetensors", "wb", buffering=0) as handle:
        write_safetensors(handle, tensors, {"k": "v"})
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as read:
        assert read.metadata() == {"k": "v"}
        assert sorted(read.keys()) == ["a", "b", "e"]
        for key, tensor in tensors.items():
            assert torch.equal(read.get_tensor(key), tensor) and read.get_tensor(key).dtype == tensor.dtype
