"""Fuzzing the header and the metadata of a valid dump: the only answers are a report or a clean exit 2.

A few hundred derandomized examples run in CI; set GRADAUDIT_FUZZ_EXAMPLES=5000 (for instance) for more,
and run pytest with --hypothesis-show-statistics to see how the examples were answered.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradaudit.cli import main

from .cli import COMMANDS, Outcome, assert_report_or_clean_refusal, no_hang
from .corpus import rank_path, read_parts, write_valid_step

EXAMPLES = int(os.environ.get("GRADAUDIT_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DEEP = "\u0000deep\u0000"
"""A placeholder substituted by a 20000-deep JSON list after encoding (json.dumps itself would recurse)."""


class Workspace:
    """One valid step folder whose rank 1 file each example replaces with a mutated copy."""

    def __init__(self, *, stats_only: bool = False) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="gradaudit-fuzz-"))
        self.step_dir = write_valid_step(self.root / "step_7", stats_only=stats_only)
        self.target = rank_path(self.step_dir, 1)
        self.original = self.target.read_bytes()
        parts = read_parts(self.target)
        self.header = parts.header
        self.data = parts.data
        self.header_length = struct.unpack("<Q", self.original[:8])[0]
        self.tally: Counter = Counter()

    def answer(self, command: str, file_bytes: bytes) -> Outcome:
        self.target.write_bytes(file_bytes)
        out, err = io.StringIO(), io.StringIO()
        with no_hang(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([command, str(self.step_dir)])
                code = 0
            except SystemExit as exited:
                code = 0 if exited.code is None else exited.code
        self.tally[code] += 1
        return Outcome(code=code, stdout=out.getvalue(), stderr=err.getvalue())

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def workspace():
    space = Workspace()
    yield space
    space.close()


@pytest.fixture(scope="module")
def stats_workspace():
    space = Workspace(stats_only=True)
    yield space
    space.close()


# ------------------------------------------------------------------ byte-level mutations


@st.composite
def byte_mutations(draw, original: bytes, header_length: int) -> bytes:
    """Flips, overwrites, insertions, deletions and truncations, mostly inside the 8-byte length and the header."""
    data = bytearray(original)
    hot_end = 8 + header_length + 16
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, min(hot_end, len(data)) - 1)) if data else 0
        operation = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not data:
            break
        if operation == "flip":
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif operation == "set":
            data[position] = draw(st.sampled_from([0, 0x22, 0x5B, 0x7B, 0x7D, 0x2C, 0x30, 0x39, 0xFF, 0x80]))
        elif operation == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif operation == "delete":
            del data[position : position + draw(st.integers(1, 16))]
        else:
            del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


@pytest.mark.parametrize("command", COMMANDS)
def test_byte_mutations_of_the_header_give_a_report_or_a_clean_refusal(workspace, command):
    @FUZZ
    @given(mutated=byte_mutations(workspace.original, workspace.header_length))
    def check(mutated: bytes) -> None:
        assert_report_or_clean_refusal(workspace.answer(command, mutated))

    workspace.tally.clear()
    check()
    _report_and_check_tally(workspace.tally, f"byte mutations, {command}")


def _report_and_check_tally(tally: Counter, what: str) -> None:
    """Print how the examples were answered (pytest -s), and make sure both answers were exercised."""
    print(f"fuzz {what}: {sum(tally.values())} runs, by exit code {dict(sorted(tally.items()))}")
    if sum(tally.values()) >= 50:
        assert tally[2] > 0 and tally[0] + tally[1] > 0, tally


# ------------------------------------------------------------------ JSON-level mutations

HOSTILE_VALUES = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            1,
            -1,
            -(10**18),
            10**18,
            2**63,
            10**30,
            10**400,
            1e308,
            -1e308,
            1e-320,
            0.5,
            "nan",
            "inf",
            "-inf",
            "",
            "x",
            "2.0",
            "1.0",
            "\x1b[31m",
            "[red]x",
            "a|b`c`\nd",
            "ünï",
            [],
            [None],
            [-1],
            [10**15],
            [0, 0],
            [[0, 1]],
            {},
            {"box": {}},
            {"range": [5, 1]},
            DEEP,
        ]
    ),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)


def _plausible(old: Any) -> st.SearchStrategy:
    """A value of the same kind as `old`: the dump stays well-formed but its numbers lie."""
    if isinstance(old, bool):
        return st.booleans()
    if isinstance(old, int):
        return st.integers(0, 12)
    if isinstance(old, float):
        return st.sampled_from([0.0, 1e-30, 0.5, 1.0, 3.0, 1e30, "nan", "inf"])
    if isinstance(old, str):
        return st.sampled_from([old, "w", "b", "dp", "grad", "float32", "bfloat16", "mean", "w::grad::0"])
    return HOSTILE_VALUES


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists, in a fixed order."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key in sorted(value):
            found += _paths(value[key], prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, prefix + (index,))
    return found


def _split_metadata(header: dict) -> dict:
    """The header with its gradaudit metadata string decoded, so that mutations reach inside it."""
    copy = json.loads(json.dumps(header))
    copy["__metadata__"]["gradaudit"] = json.loads(copy["__metadata__"]["gradaudit"])
    return copy


def _encode(value: Any) -> str:
    return json.dumps(value).replace(json.dumps(DEEP), "[" * 20_000 + "]" * 20_000)


def _join(doc: dict, data: bytes) -> bytes:
    metadata = doc.get("__metadata__")
    if isinstance(metadata, dict) and isinstance(metadata.get("gradaudit"), (dict, list)):
        metadata["gradaudit"] = _encode(metadata["gradaudit"])
    header = _encode(doc).encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(header)) + header + data


@st.composite
def json_mutations(draw, header: dict, data: bytes) -> bytes:
    """Substitute wrong types, huge, negative or nan values and deep nesting, or delete keys, anywhere."""
    doc = _split_metadata(header)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        try:
            for step in path[:-1]:
                parent = parent[step]
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(parent, dict) and draw(st.booleans()) and draw(st.booleans()):
            parent.pop(path[-1], None)
        elif isinstance(parent, (dict, list)):
            try:
                old = parent[path[-1]]
                parent[path[-1]] = copy.deepcopy(draw(st.one_of(HOSTILE_VALUES, _plausible(old))))
            except (IndexError, TypeError):
                continue
    return _join(doc, data)


@pytest.mark.parametrize("command", COMMANDS)
def test_json_mutations_of_the_header_and_metadata_give_a_report_or_a_clean_refusal(workspace, command):
    @FUZZ
    @given(mutated=json_mutations(workspace.header, workspace.data))
    def check(mutated: bytes) -> None:
        assert_report_or_clean_refusal(workspace.answer(command, mutated))

    workspace.tally.clear()
    check()
    _report_and_check_tally(workspace.tally, f"JSON mutations, {command}")


def test_the_json_mutator_round_trips_an_unmutated_header(workspace):
    doc = _split_metadata(workspace.header)
    rebuilt = _join(doc, workspace.data)
    assert workspace.answer("show", rebuilt).code == 0


@st.composite
def lying_metadata(draw, header: dict, data: bytes) -> bytes:
    """Well-formed metadata whose values lie: every substitution keeps the kind of the value it
    replaces, so most examples pass the loader and reach the checks with numbers that disagree."""
    doc = _split_metadata(header)
    metadata = doc["__metadata__"]["gradaudit"]
    leaves = [p for p in _paths(metadata) if not isinstance(_at(metadata, p), (dict, list))]
    for path in draw(st.lists(st.sampled_from(leaves), min_size=1, max_size=3)):
        parent = _at(metadata, path[:-1])
        parent[path[-1]] = draw(_plausible(parent[path[-1]]))
    return _join(doc, data)


def _at(value: Any, path: tuple) -> Any:
    for step in path:
        value = value[step]
    return value


@pytest.mark.parametrize("dump", ["values", "stats-only"])
def test_metadata_that_lies_consistently_gives_a_report_or_a_clean_refusal(request, dump):
    """Aimed at the checks (show is covered above): half the examples, on both kinds of dump."""
    space = request.getfixturevalue("workspace" if dump == "values" else "stats_workspace")
    command = "check"

    @settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
    @given(mutated=lying_metadata(space.header, space.data))
    def check(mutated: bytes) -> None:
        assert_report_or_clean_refusal(space.answer(command, mutated))

    space.tally.clear()
    check()
    _report_and_check_tally(space.tally, f"lying metadata ({dump}), {command}")
