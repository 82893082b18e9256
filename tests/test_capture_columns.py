"""The stats capture's columnar builder (capture/write.py::_columnar) against the general path that
builds a Piece and a TensorStats per piece: the loaded rank dumps are equal, and every piece's
statistics are those of stats_of_tensor (and, within rounding, of the chunked accumulator)."""

from __future__ import annotations

import math

import pytest
import torch
from capture_support import MAX_NORM, single_process  # noqa: F401 - autouse fixture

import gradaudit
from gradaudit.capture import LocalPiece
from gradaudit.capture import write as capture_write
from gradaudit.capture.tensorstats import SMALL_ELEMENTS, StatsAccumulator, stats_of_tensor
from gradaudit.dumpfile import load_step
from gradaudit.dumpfile.columnar import ColumnarPieces
from gradaudit.model import Box, FlatRange


class Mixed(torch.nn.Module):
    """Parameters of several shapes and dtypes, one larger than a batch's tensors, and one split
    into two flat ranges and one box handed over with ownership= (the ZeRO and tensor-parallel forms)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(40))
        self.matrix = torch.nn.Parameter(torch.randn(3, 5))
        self.narrow = torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16))
        self.wide = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.float64))
        self.large = torch.nn.Parameter(torch.randn(SMALL_ELEMENTS + 7))
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        self.sharded = torch.nn.Parameter(torch.randn(4, 6))
        self.boxed = torch.nn.Parameter(torch.randn(4, 6))

    def fill_gradients(self) -> None:
        generator = torch.Generator().manual_seed(1)
        for name, param in self.named_parameters():
            if param.requires_grad:
                param.grad = (torch.randn(param.shape, generator=generator) * 3).to(param.dtype)
                if name == "small.3":
                    param.grad[1], param.grad[2] = math.nan, math.inf
                if name == "matrix":
                    param.grad[0, 0] = -math.inf
        self.small[5].grad = None  # unused this step: leaves no trace

    def ownership(self) -> list[LocalPiece]:
        sharded, boxed = self.sharded, self.boxed

        def flat_piece(start: int, stop: int) -> LocalPiece:
            return LocalPiece(
                param="sharded",
                global_shape=(4, 6),
                dtype="float32",
                regions=(FlatRange(start=start, stop=stop),),
                local_shape=(stop - start,),
                grad=lambda: sharded.grad.reshape(-1)[start:stop],
                value=lambda: sharded.detach().reshape(-1)[start:stop],
                replica_group="dp",
            )

        rows = LocalPiece(
            param="boxed",
            global_shape=(8, 6),
            dtype="float32",
            regions=(Box(offsets=(4, 0), shape=(4, 6)),),
            local_shape=(4, 6),
            grad=lambda: boxed.grad,
            value=lambda: boxed.detach(),
        )
        return [flat_piece(0, 10), flat_piece(10, 24), rows]


def _capture(tmp_path, name, *, columnar: bool, monkeypatch, norm_type=2.0, model=None):
    model = model or Mixed()
    model.fill_gradients()
    with monkeypatch.context() as patched:
        if not columnar:
            patched.setattr(capture_write, "_columnar", lambda snapshots: None)
        with gradaudit.audit_step(
            model,
            tmp_path / name,
            step=1,
            max_norm=MAX_NORM,
            norm_type=norm_type,
            mode="stats",
            strict=True,
            groups={"dp": [0]},
            ownership=model.ownership() if isinstance(model, Mixed) else None,
            run_id="same",
        ):
            pass
    return model, load_step(tmp_path / name / "step_1").ranks[0]


def _same_apart_from_the_moment(fast, slow):
    differ = {"path", "created_at", "num_bytes"}
    for field in type(fast).__dataclass_fields__:
        if field not in differ:
            assert getattr(fast, field) == getattr(slow, field), field


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_the_columns_built_from_the_rows_load_as_the_pieces_the_general_path_writes(
    tmp_path, monkeypatch, norm_type
):
    model, fast = _capture(tmp_path, "fast", columnar=True, monkeypatch=monkeypatch, norm_type=norm_type)
    _, slow = _capture(tmp_path, "slow", columnar=False, monkeypatch=monkeypatch, norm_type=norm_type)
    assert isinstance(fast.pieces, ColumnarPieces) and isinstance(slow.pieces, ColumnarPieces)
    _same_apart_from_the_moment(fast, slow)
    assert list(fast.pieces) == list(slow.pieces)
    by_param = {p.param: p for p in fast.pieces if p.param not in ("sharded", "boxed")}
    assert "small.5" not in by_param and "frozen" not in by_param
    assert {p.replica_group for p in fast.pieces} == {"dp", None}  # "boxed" has none
    assert [p.regions for p in fast.pieces if p.param == "sharded"] == [
        (FlatRange(start=0, stop=10),),
        (FlatRange(start=10, stop=24),),
    ]
    assert next(p for p in fast.pieces if p.param == "boxed").regions == (Box(offsets=(4, 0), shape=(4, 6)),)
    assert fast.param("boxed").global_shape == (8, 6) and fast.param("narrow").dtype == "bfloat16"
    for name, param in model.named_parameters():
        if name not in by_param:
            continue
        got, want = by_param[name].stats["grad"], stats_of_tensor(param.grad, norm_type)
        assert got == want, name  # the same numbers as a batch of one: batching changes no bit
        accumulator = StatsAccumulator(norm_type)
        accumulator.add(param.grad)
        old = accumulator.result()
        assert (got.num_nan, got.num_posinf, got.num_neginf, got.max_abs, got.numel) == (
            old.num_nan,
            old.num_posinf,
            old.num_neginf,
            old.max_abs,
            old.numel,
        )
        assert got.sum_pow == pytest.approx(old.sum_pow, rel=1e-12)
        assert got.sum_sq == pytest.approx(old.sum_sq, rel=1e-12)
        assert got.fingerprint == pytest.approx(old.fingerprint, rel=1e-9, abs=1e-12)
    counts = by_param["small.3"].stats["grad"]
    assert (counts.num_nan, counts.num_posinf, counts.num_neginf) == (1, 1, 0)
    assert by_param["matrix"].stats["grad"].num_neginf == 1


def test_a_capture_the_columns_cannot_hold_goes_the_general_way_and_loads_the_same(tmp_path, monkeypatch):
    class WithScalar(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(2.0))  # a 0-D box: no columns
            self.weight = torch.nn.Parameter(torch.randn(3))

        def fill_gradients(self) -> None:
            self.scale.grad, self.weight.grad = torch.tensor(0.5), torch.tensor([1.0, -2.0, 3.0])

    _, fast = _capture(tmp_path, "fast", columnar=True, monkeypatch=monkeypatch, model=WithScalar())
    _, slow = _capture(tmp_path, "slow", columnar=False, monkeypatch=monkeypatch, model=WithScalar())
    assert not fast.columns.stats_only  # the JSON form (format 1.0), not the 1.1 columns
    _same_apart_from_the_moment(fast, slow)
    assert fast.pieces[0].stats["grad"].sum_sq == 0.25


def test_a_parameter_whose_gradient_cannot_be_summarized_is_left_out_alone(tmp_path, monkeypatch):
    from gradaudit.capture import tensorstats

    model = Mixed()
    real = tensorstats._batch_rows

    def refuse_bfloat16(x, weights, norm_type):
        if x.shape[1] == 6:  # the bfloat16 parameter's batch, and the one-by-one retry
            raise RuntimeError("cannot read this gradient")
        return real(x, weights, norm_type)

    monkeypatch.setattr(tensorstats, "_batch_rows", refuse_bfloat16)
    with pytest.warns(UserWarning, match="leaves out parameter 'narrow'"):
        model.fill_gradients()
        with gradaudit.audit_step(model, tmp_path, step=1, max_norm=MAX_NORM, mode="stats"):
            pass
    dump = load_step(tmp_path / "step_1").ranks[0]
    assert "narrow" not in {p.param for p in dump.pieces}
    assert [p.name for p in dump.not_captured] == ["narrow"]
    assert "small.0" in {p.param for p in dump.pieces}


def test_a_whole_replica_filled_in_directly_is_the_local_piece_its_constructor_makes():
    import dataclasses

    from gradaudit.capture.plain import whole_pieces

    param = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float16))
    param.grad = torch.ones(2, 3, dtype=torch.float16)
    (piece,) = whole_pieces("w", "local.w", param, "dp")
    made = LocalPiece(
        param="w",
        global_shape=(2, 3),
        dtype="float16",
        regions=(Box(offsets=(0, 0), shape=(2, 3)),),
        local_shape=(2, 3),
        grad=piece.grad,
        value=piece.value,
        replica_group="dp",
        local_name="local.w",
    )
    assert piece == made and vars(piece).keys() == {f.name for f in dataclasses.fields(LocalPiece)}
    assert torch.equal(piece.grad(), param.grad) and torch.equal(piece.value(), param.detach())
    assert whole_pieces("empty", None, torch.nn.Parameter(torch.zeros(0, 3)), None) == []
