"""Reading FSDP1 FlatParameter shard metadata into flat ranges of the original parameters, without
any process group (the metadata is given as plain attributes, the way FSDP1 stores it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gradaudit.capture.fsdp1 import fsdp1_groups, fsdp1_pieces, param_shards
from gradaudit.errors import CaptureError


def _info(in_shard, offset=None, numel=None, start=None, end=None):
    """FSDP1's _ShardParamInfo fields: in_shard, offset_in_shard, numel_in_shard, intra start, intra end (inclusive)."""
    return (in_shard, offset, numel, start, end)


def _flat_param(**overrides):
    """A rank's view of a FlatParameter holding w (3x4) and b (4) unsharded as [w | pad | b | pad],
    sharded over 2 ranks in chunks of 10: this rank (1) holds w[10:12], alignment padding, then all of b."""
    fields = {
        "_fqns": ("layer.w", "layer.b"),
        "_shapes": (torch.Size([3, 4]), torch.Size([4])),
        "_numels": (12, 4),
        "_contiguities": (True, True),
        "_shard_param_infos": (_info(True, 0, 2, 10, 11), _info(True, 4, 4, 0, 3)),
        "_sharded_size": torch.Size([10]),
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_each_original_parameter_in_the_shard_becomes_its_flat_range_past_the_padding():
    shards = param_shards(_flat_param())
    assert [
        (s.fqn, s.global_shape, s.start, s.stop, s.offset_in_shard, s.numel_in_shard) for s in shards
    ] == [
        ("layer.w", (3, 4), 10, 12, 0, 2),
        ("layer.b", (4,), 0, 4, 4, 4),
    ]
    assert [s.index for s in shards] == [0, 1]


def test_parameters_outside_this_ranks_shard_give_no_piece():
    flat = _flat_param(_shard_param_infos=(_info(False), _info(True, 0, 4, 0, 3)))
    assert [s.fqn for s in param_shards(flat)] == ["layer.b"]


def test_a_parameter_without_elements_gives_no_piece_even_where_fsdp1_marks_it_in_shard():
    flat = _flat_param(
        _fqns=("layer.w", "empty"),
        _shapes=(torch.Size([3, 4]), torch.Size([0])),
        _numels=(12, 0),
        _shard_param_infos=(_info(True, 0, 2, 10, 11), _info(True, 2, 0, 5, 4)),
    )
    assert [s.fqn for s in param_shards(flat)] == ["layer.w"]


def test_missing_shard_metadata_raises_a_capture_error_that_says_what_to_pass_instead():
    flat = _flat_param()
    del flat._shard_param_infos
    with pytest.raises(CaptureError, match="ownership="):
        param_shards(flat)


def test_per_parameter_lists_of_different_lengths_are_refused():
    with pytest.raises(CaptureError, match="different lengths"):
        param_shards(_flat_param(_numels=(12,)))


@pytest.mark.parametrize(
    "info",
    [
        _info(True, 0, 3, 10, 12),  # runs past the end of w
        _info(True, 0, 5, 10, 11),  # numel disagrees with the range
        _info(True, 9, 2, 10, 11),  # runs past the end of the local shard
        _info(True, None, 2, 10, 11),  # in the shard but without an offset
    ],
)
def test_shard_info_that_is_not_a_range_of_the_parameter_is_refused(info):
    with pytest.raises(CaptureError, match="not a range|not integer offsets"):
        param_shards(_flat_param(_shard_param_infos=(info, _info(True, 4, 4, 0, 3))))


def test_a_non_contiguous_parameter_is_refused_because_its_shard_is_not_row_major():
    with pytest.raises(CaptureError, match="layer.w is not contiguous"):
        param_shards(_flat_param(_contiguities=(False, True)))


def test_a_model_without_fsdp1_has_no_fsdp1_pieces_or_groups():
    pytest.importorskip("torch.distributed.fsdp")  # loaded, so the modules are really looked at
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    assert fsdp1_pieces(model) is None
    assert fsdp1_groups(model) == {}
