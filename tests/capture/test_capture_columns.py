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
    differ = {"path", "created_at", "num_bytes", "header_digest"}  # the digest covers created_at
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
    assert not fast.pieces.stats_only  # the JSON form (format 1.0), not the 1.1 columns
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


def test_a_whole_row_reads_as_the_local_piece_of_its_tensor_and_an_edit_keeps_the_rows_in_order():
    from gradaudit.capture.plain import LocalPieces, whole_pieces, whole_rows

    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    for param in params:
        param.grad = torch.randn_like(param)
    (sharded,) = whole_pieces("sharded", "local.sharded", torch.nn.Parameter(torch.randn(5)), "tp")
    (odd,) = whole_pieces("odd", None, torch.ones(2, dtype=torch.int64), None)
    held = LocalPieces.joined(
        [
            LocalPieces.of([sharded]),
            LocalPieces.of_whole(whole_rows(["a", "b"], params), "dp"),
            LocalPieces.of([odd]),
        ]
    )
    assert held.whole is not None and held.whole.positions.tolist() == [1, 2]
    assert held.read_one_by_one() == [0, 3] and held[0] == sharded and held[-1] == odd
    (made,) = whole_pieces("b", None, params[1], "dp")
    row = held[2]
    assert (row.param, row.regions, row.local_shape, row.replica_group) == ("b", made.regions, (4,), "dp")
    assert torch.equal(row.grad(), params[1].grad) and torch.equal(row.value(), params[1].detach())
    with pytest.raises(IndexError):
        held[4]

    edited = held.edited({0: None})  # the first row dropped: the whole rows move up
    assert edited.params == ["a", "b", "odd"] and edited.whole.positions.tolist() == [0, 1]
    assert edited.positions_of("b") == [1] and edited[1].param == "b"


class Plain(torch.nn.Module):
    """What the whole replicas held as columns must carry as the per-object path does: many small
    parameters, a non-contiguous gradient, bfloat16 and float64, a parameter without a gradient, one
    without elements (this rank holds nothing of it), a frozen one, a larger one, and optional
    pieces handed over with ownership= around them (a rank holding whole and sharded parameters)."""

    def __init__(self, *, sharded: bool = False) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(4)) for _ in range(30))
        self.transposed = torch.nn.Parameter(torch.randn(5, 3))
        self.narrow = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.bfloat16))
        self.wide = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
        self.unused = torch.nn.Parameter(torch.randn(4))
        self.empty = torch.nn.Parameter(torch.zeros(0, 3))
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        self.large = torch.nn.Parameter(torch.randn(SMALL_ELEMENTS + 3))
        self.sharded = torch.nn.Parameter(torch.randn(4, 6)) if sharded else None

    def fill_gradients(self) -> None:
        generator = torch.Generator().manual_seed(3)
        for name, param in self.named_parameters():
            if param.requires_grad and name not in ("unused", "empty"):
                param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        self.transposed.grad = torch.randn(3, 5, generator=generator).t()
        assert not self.transposed.grad.is_contiguous()
        self.small[7].grad[2] = math.nan

    def ownership(self) -> list[LocalPiece] | None:
        if self.sharded is None:
            return None
        sharded = self.sharded
        return [
            LocalPiece(
                param="sharded",
                global_shape=(4, 6),
                dtype="float32",
                regions=(FlatRange(start=start, stop=stop),),
                local_shape=(stop - start,),
                grad=lambda start=start, stop=stop: sharded.grad.reshape(-1)[start:stop],
                value=lambda start=start, stop=stop: sharded.detach().reshape(-1)[start:stop],
                replica_group="dp",
            )
            for start, stop in ((0, 10), (10, 24))
        ]


def _written(
    tmp_path, name, model, monkeypatch, *, path: str, mode: str = "stats", **options
) -> dict[str, bytes]:
    """The files one capture of `model` writes, by name, with the moment of writing blanked: the
    fast path (columns from inference to the file), the per-object path (a LocalPiece per parameter,
    the columns built from the objects) or the general one (a Piece per piece)."""
    from gradaudit.capture import infer

    model.fill_gradients()
    with monkeypatch.context() as patched:
        if path != "fast":
            patched.setattr(infer, "_whole_replicas", lambda *args: None)
        if path == "general":
            patched.setattr(capture_write, "_columnar", lambda snapshots: None)
        with gradaudit.audit_step(
            model,
            tmp_path / name,
            step=1,
            max_norm=MAX_NORM,
            mode=mode,
            strict=True,
            groups={"dp": [0]},
            ownership=model.ownership(),
            run_id="same",
            **options,
        ):
            if "optimizer" in options:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                options["optimizer"].step()
    files = {}
    for file in sorted((tmp_path / name / "step_1").iterdir()):
        data = file.read_bytes()
        stamp = data.find(b"created_at")
        if stamp >= 0:  # the same length whatever the moment: "YYYY-MM-DDTHH:MM:SS+00:00"
            data = data[: stamp + 16] + b"#" * 25 + data[stamp + 16 + 25 :]
        files[file.name] = data
    return files


@pytest.mark.parametrize("sharded", [False, True])
def test_the_whole_replicas_held_as_columns_write_the_bytes_the_per_object_path_writes(
    tmp_path, monkeypatch, sharded
):
    from gradaudit.capture.infer import infer_ownership
    from gradaudit.capture.plain import LocalPieces

    model = Plain(sharded=sharded)
    held = infer_ownership(
        model, rank=0, world_size=1, groups={"dp": ((0,),)}, aliases={}, on_unsupported=print
    ).pieces
    assert isinstance(held, LocalPieces) and held.whole is not None
    assert "empty" not in held.whole.names and "frozen" not in held.whole.names
    fast = _written(tmp_path, "fast", model, monkeypatch, path="fast")
    assert fast == _written(tmp_path, "objects", model, monkeypatch, path="objects")
    assert fast == _written(tmp_path, "general", model, monkeypatch, path="general")
    dump = load_step(tmp_path / "fast" / "step_1").ranks[0]
    assert isinstance(dump.pieces, ColumnarPieces)
    by_param = {p.param: p for p in dump.pieces}
    assert "unused" not in by_param and "empty" not in by_param and "frozen" not in by_param
    assert by_param["transposed"].stats["grad"] == stats_of_tensor(model.transposed.grad, 2.0)
    assert by_param["small.7"].stats["grad"].num_nan == 1
    assert dump.param("narrow").dtype == "bfloat16" and dump.param("wide").dtype == "float64"
    order = [p.param for p in dump.pieces]
    assert order[:2] == ["transposed", "narrow"] and (order[-2:] == ["sharded", "sharded"]) == sharded


def test_full_mode_and_values_of_chosen_parameters_read_the_whole_replicas_one_by_one(tmp_path, monkeypatch):
    model = Plain(sharded=True)
    fast = _written(tmp_path, "fast", model, monkeypatch, path="fast", mode="full")
    assert fast == _written(tmp_path, "objects", model, monkeypatch, path="objects", mode="full")
    dump = load_step(tmp_path / "fast" / "step_1").ranks[0]
    assert not dump.pieces.stats_only  # the JSON form (format 1.0), not the 1.1 columns
    assert {p.param for p in dump.pieces} >= {"transposed", "narrow", "small.0", "sharded"}


def test_a_step_after_one_with_the_same_parameters_reuses_their_table_and_one_after_a_change_does_not(
    tmp_path, monkeypatch
):
    model = Plain()
    first = _written(tmp_path, "first", model, monkeypatch, path="fast")
    assert _written(tmp_path, "again", model, monkeypatch, path="fast") == first
    with torch.no_grad():
        model.wide = torch.nn.Parameter(
            torch.randn(2, 7, dtype=torch.float16)
        )  # same name, new shape and dtype
    changed = _written(tmp_path, "changed", model, monkeypatch, path="fast")
    assert changed == _written(tmp_path, "changed_objects", model, monkeypatch, path="objects")
    dump = load_step(tmp_path / "changed" / "step_1").ranks[0]
    assert dump.param("wide").global_shape == (2, 7) and dump.param("wide").dtype == "float16"
    first_dump = load_step(tmp_path / "first" / "step_1").ranks[0]
    assert first_dump.param("wide").global_shape == (7,)


def test_the_parameters_walked_module_by_module_are_those_named_parameters_gives_in_its_order():
    from gradaudit.capture.names import logical_name, logical_parameter_columns

    class Wrapper(torch.nn.Module):  # what torch.compile inserts: its name leaves the logical one
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self._orig_mod = inner

    shared = torch.nn.Linear(3, 3)
    inner = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Linear(3, 2, bias=False))
    inner.register_parameter("none", None)
    inner.tied = inner[3].weight  # one tensor under two names: listed once, at its first place
    inner.extra = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(2)), inner[0].bias])
    model = Wrapper(inner)
    logicals, fqns, params = logical_parameter_columns(model)
    named = list(model.named_parameters())
    assert fqns == [n for n, _ in named] and all(a is b for a, (_, b) in zip(params, named, strict=True))
    assert logicals == [logical_name(model, n) for n, _ in named]
    assert (fqns[0], logicals[0], fqns[-1]) == ("_orig_mod.tied", "tied", "_orig_mod.extra.0")


def test_a_model_that_names_its_parameters_its_own_way_is_asked_for_them():
    from gradaudit.capture.names import logical_parameter_columns

    model = torch.nn.Linear(2, 2)
    model.named_parameters = lambda: iter([("only", model.weight)])  # an instance's own walk
    assert logical_parameter_columns(model) == (["only"], ["only"], [model.weight])


def test_a_stats_step_with_an_optimizer_and_values_of_chosen_parameters_writes_the_per_object_bytes(
    tmp_path, monkeypatch
):
    model = Plain()
    written = {}
    for path in ("fast", "objects"):
        torch.manual_seed(5)
        fresh = Plain()
        optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1)
        written[path] = _written(
            tmp_path, path, fresh, monkeypatch, path=path, optimizer=optimizer, full_params=["small.1*"]
        )
    assert written["fast"] == written["objects"]
    dump = load_step(tmp_path / "fast" / "step_1").ranks[0]
    kinds = {p.param: (set(p.tensors), set(p.stats)) for p in dump.pieces}
    assert kinds["small.12"] == (
        {"grad", "grad_clipped", "param_before", "param_after"},
        {"grad", "grad_clipped"},
    )
    assert kinds["narrow"] == (set(), {"grad", "grad_clipped"})
    assert model.small[12].grad is None  # the model of the comparison, untouched


def test_the_pieces_of_a_parameter_are_found_among_objects_and_replicas_alike():
    from gradaudit.capture.infer import infer_ownership

    model = Plain(sharded=True)
    held = infer_ownership(
        model,
        rank=0,
        world_size=1,
        groups={"dp": ((0,),)},
        aliases={},
        explicit=model.ownership(),
        on_unsupported=print,
    ).pieces
    names = [p.param for p in held]
    for name in ("sharded", "small.3", "large", "absent"):
        assert held.positions_of(name) == [i for i, n in enumerate(names) if n == name]
    assert held[-1].param == "sharded" and held[-len(held)].param == names[0]
    with pytest.raises(IndexError):
        held[-len(held) - 1]
