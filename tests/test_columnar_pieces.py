"""Format-1.1 pieces stay columns: a sequence that builds each Piece when asked, equal to the tuple."""

from __future__ import annotations

import pytest
from test_format_1_1 import _rewrite_columns, _stats_step, _write_json_1_0

from gradaudit.dumpfile import load_rank_file
from gradaudit.dumpfile.columnar import ColumnarPieces, ParamIds, counts_key
from gradaudit.errors import DumpFormatError


def _both_forms(tmp_path, rank=1):
    path = _stats_step(tmp_path / "v11", rank=rank, world_size=2)
    columnar = load_rank_file(path)
    _write_json_1_0(tmp_path / "v10", columnar)
    return columnar, load_rank_file(tmp_path / "v10" / path.name)


def test_columnar_pieces_equal_the_tuple_the_json_form_of_the_same_rank_gives(tmp_path):
    columnar, json_form = _both_forms(tmp_path)
    pieces, expected = columnar.pieces, json_form.pieces
    assert isinstance(pieces, ColumnarPieces) and isinstance(expected, tuple)
    assert pieces == expected and expected == pieces
    assert (pieces != expected) is False
    assert tuple(pieces) == expected and list(pieces) == list(expected)
    assert [pieces[i] for i in range(len(pieces))] == list(expected)
    assert pieces[-1] == expected[-1] and pieces[1:] == expected[1:]
    assert load_rank_file(columnar.path).pieces == pieces
    with pytest.raises(IndexError):
        pieces[len(expected)]


def test_columnar_pieces_differ_from_a_tuple_with_one_piece_changed(tmp_path):
    import dataclasses

    columnar, json_form = _both_forms(tmp_path)
    changed = list(json_form.pieces)
    changed[1] = dataclasses.replace(changed[1], replica_group="other")
    assert columnar.pieces != tuple(changed)
    assert columnar.pieces != json_form.pieces[:-1]


def test_the_columns_of_columnar_pieces_are_read_only_and_give_sizes_and_layouts(tmp_path):
    columnar, json_form = _both_forms(tmp_path)
    pieces = columnar.pieces
    assert isinstance(pieces, ColumnarPieces)
    with pytest.raises(ValueError):
        pieces.rows[0, 0] = 1
    assert pieces.numel.tolist() == [p.numel for p in json_form.pieces]
    layouts = pieces.layout(pieces.layout_width).tolist()
    keys = [p.layout_key for p in json_form.pieces]
    for i in range(len(keys)):
        for j in range(len(keys)):
            assert (layouts[i] == layouts[j]) == (keys[i] == keys[j])
    ids = ParamIds(["emb", "layers.0.w", "norm"])
    assert ids.of(pieces).tolist() == [1, 0, 2]


def test_a_box_with_more_nonfinite_values_than_elements_is_refused_naming_the_piece(tmp_path):
    path = _stats_step(tmp_path, world_size=1)
    _rewrite_columns(path, lambda a, d: a[counts_key("grad")].__setitem__((0, 1), 10**6))
    with pytest.raises(DumpFormatError, match="piece 0: more nonfinite values than elements"):
        load_rank_file(path)
