"""gradaudit's pytest plugin: `@pytest.mark.gradaudit_distributed(world_size=2)` runs a test body on
every rank of a fresh CPU gloo group, and the `gradaudit_rank` fixture tells the body which rank it is.

    @pytest.mark.gradaudit_distributed(world_size=4, mesh={"dp": 2, "tp": 2}, timeout=60)
    def test_my_layer(gradaudit_rank, tmp_path):
        model = parallelize(build(), gradaudit_rank.mesh)
        ...

pytest loads this module in every run of anyone who installed gradaudit (the pytest11 entry point), so
it imports only pytest and the standard library, and it changes nothing for tests without the marker.
A marked test fails once, with the traceback of every rank that raised, died or hung; a skip on any
rank skips it. The test function (module level) and the values of the fixtures it asks for are sent
to the ranks by pickling, so fixtures must give picklable values (tmp_path does; capsys does not).
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import math
import pickle
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import CodeType
from typing import Any

import pytest

MARKER = "gradaudit_distributed"
FIXTURE = "gradaudit_rank"
DEFAULT_WORLD_SIZE = 2
DEFAULT_STEPS = 2
DEFAULT_TIMEOUT_S = 120.0


def _type_name(kind: type[BaseException]) -> str:
    """As the launcher names a rank's exception (pytest's outcome classes call their module "builtins")."""
    return f"{kind.__module__}.{kind.__qualname__}"


_SKIPPED = _type_name(pytest.skip.Exception)
_XFAILED = _type_name(pytest.xfail.Exception)


@dataclass(frozen=True, kw_only=True)
class DistributedRank:
    """What the `gradaudit_rank` fixture gives a marked test body on each rank."""

    rank: int
    """This rank."""
    world_size: int
    """Ranks the marked test runs on."""
    mesh: Any
    """A torch DeviceMesh of the marker's `mesh` ({axis name: size}; default {"dp": world_size})."""
    steps: int
    """The marker's `steps`: how many training steps the body is asked to run."""


@dataclass(frozen=True, kw_only=True)
class _Options:
    world_size: int
    mesh: tuple[tuple[str, int], ...]
    steps: int
    timeout_s: float


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "gradaudit_timeout",
        f"default per-test timeout in seconds of tests marked {MARKER} (default {DEFAULT_TIMEOUT_S:g})",
        default=str(DEFAULT_TIMEOUT_S),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size={DEFAULT_WORLD_SIZE}, mesh=None, steps={DEFAULT_STEPS}, timeout=None): run the "
        f"test body on world_size CPU gloo ranks (gradaudit); the {FIXTURE} fixture gives each its rank and mesh",
    )


@pytest.fixture
def gradaudit_rank(request: pytest.FixtureRequest) -> DistributedRank:
    """This rank, its world size, its DeviceMesh and the marker's steps (inside a marked test only)."""
    options = _options(request.node)  # outside a marked test, a clear failure
    # The body runs on the ranks, where the plugin passes the real value; this one is never seen.
    return DistributedRank(rank=-1, world_size=options.world_size, mesh=None, steps=options.steps)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker(MARKER) is None:
        return None
    options = _options(pyfuncitem)
    from ..localranks import NotSendableError, launch, sendable

    names = pyfuncitem._fixtureinfo.argnames
    values = {name: pyfuncitem.funcargs[name] for name in names if name != FIXTURE}
    try:
        for name, value in values.items():
            sendable(
                f"the value of fixture {name!r} of {pyfuncitem.nodeid}",
                value,
                "a marked test can ask only for fixtures whose values pickle (tmp_path does, capsys and "
                "monkeypatch do not); use them inside the body instead",
            )
        fn_data = sendable(f"the test function {pyfuncitem.nodeid}", pyfuncitem.obj)
    except NotSendableError as exc:
        pytest.fail(str(exc), pytrace=False)
    module = pyfuncitem.module
    args = (
        getattr(module, "__name__", ""),
        getattr(module, "__file__", None),
        fn_data,
        pickle.dumps(values),
        FIXTURE in names,
        options,
    )
    outcomes = launch(_rank_body, options.world_size, args, timeout_s=options.timeout_s)
    for kind, outcome_fn in ((_SKIPPED, pytest.skip), (_XFAILED, pytest.xfail)):
        hits = [o for o in outcomes if o.status == "raised" and o.exc_type == kind]
        if hits:
            outcome_fn(f"rank {hits[0].rank}: {hits[0].message}")
    failed = [o for o in outcomes if o.status != "ok"]
    if failed:
        from ..localranks import failure_text

        ranks = ", ".join(str(o.rank) for o in failed)
        pytest.fail(
            f"{len(failed)} of {options.world_size} ranks failed (rank{'s' if len(failed) > 1 else ''} "
            f"{ranks}):\n{failure_text(failed)}",
            pytrace=False,
        )
    return True


def _options(node: pytest.Item) -> _Options:
    marker = node.get_closest_marker(MARKER)
    if marker is None:
        pytest.fail(f"the {FIXTURE} fixture needs the test marked @pytest.mark.{MARKER}(...)", pytrace=False)
    if marker.args:
        pytest.fail(
            f"{MARKER} takes keyword arguments only: world_size=, mesh=, steps=, timeout=", pytrace=False
        )
    unknown = sorted(set(marker.kwargs) - {"world_size", "mesh", "steps", "timeout"})
    if unknown:
        pytest.fail(
            f"{MARKER} got unknown arguments {unknown}; it takes world_size, mesh, steps, timeout",
            pytrace=False,
        )
    world_size = marker.kwargs.get("world_size", DEFAULT_WORLD_SIZE)
    steps = marker.kwargs.get("steps", DEFAULT_STEPS)
    for name, value in (("world_size", world_size), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            pytest.fail(f"{MARKER}: {name} must be a positive int, got {value!r}", pytrace=False)
    mesh = marker.kwargs.get("mesh")
    axes = _mesh_axes(mesh, world_size)
    timeout = marker.kwargs.get("timeout")
    if timeout is None:
        timeout = float(node.config.getini("gradaudit_timeout"))
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        pytest.fail(f"{MARKER}: timeout must be a positive number of seconds, got {timeout!r}", pytrace=False)
    return _Options(world_size=world_size, mesh=axes, steps=steps, timeout_s=float(timeout))


def _mesh_axes(mesh: object, world_size: int) -> tuple[tuple[str, int], ...]:
    if mesh is None:
        return (("dp", world_size),)
    if isinstance(mesh, Mapping) and mesh:
        axes = tuple((str(k), v) for k, v in mesh.items())
        sizes = [s if isinstance(s, int) and not isinstance(s, bool) and s > 0 else 0 for _, s in axes]
        if math.prod(sizes) == world_size:
            return axes
    pytest.fail(
        f"{MARKER}: mesh must be {{axis name: size}} with sizes multiplying to world_size {world_size}, e.g. "
        f'{{"dp": 2, "tp": 2}}; got {mesh!r}',
        pytrace=False,
    )


def _rank_body(
    rank: int,
    world_size: int,
    module_name: str,
    module_file: str | None,
    fn_data: bytes,
    values_data: bytes,
    wants_rank: bool,
    options: _Options,
) -> None:
    """Runs in each rank: import the test module (asserts rewritten as pytest does), call the body."""
    _import_test_module(module_name, module_file)
    fn = pickle.loads(fn_data)
    values = pickle.loads(values_data)
    if wants_rank:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            "cpu", tuple(s for _, s in options.mesh), mesh_dim_names=tuple(n for n, _ in options.mesh)
        )
        values[FIXTURE] = DistributedRank(rank=rank, world_size=world_size, mesh=mesh, steps=options.steps)
    fn(**values)


def _import_test_module(name: str, path: str | None) -> None:
    """Import the test module from its file under the name pytest gave it, with pytest's assertion
    rewriting (so that a failed `assert` on a rank shows its values); a plain import where that cannot be."""
    if not name or name in sys.modules:
        return
    if path is None or not path.endswith(".py"):
        importlib.import_module(name)
        return
    loader = _AssertRewritingLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None  # a .py path and a loader always give a spec
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


class _AssertRewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles the test file as pytest does in its own process: with its asserts rewritten."""

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        source = self.get_data(path)
        tree = ast.parse(source, filename=path)
        try:
            from _pytest.assertion.rewrite import rewrite_asserts

            rewrite_asserts(tree, source, path)
        except Exception:  # noqa: BLE001  pytest's internals changed: the asserts simply stay plain
            tree = ast.parse(source, filename=path)
        code: CodeType = compile(tree, path, "exec", dont_inherit=True)
        return code
