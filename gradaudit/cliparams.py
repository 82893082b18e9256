"""Plain conversion of the command line's values, in place of the pydantic adapters typer builds.

typer (0.29 and later) converts every parsed parameter that is not a bool flag through a pydantic
`TypeAdapter`, built on first use: importing pydantic and building the adapters costs about as much as
the rest of a small `gradaudit check`. typer builds each parameter's converter lazily ("to avoid up-front
costs") into the parameter's `_runtime_param` slot, so a converter placed there first is used instead.
The parameters here are paths, strings, floats and enum choices, which need no pydantic. Where typer
does not have that slot (another version), nothing is placed and typer converts as before: slower, never
different.
"""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any


class PlainParam:
    """Converts one parameter's value like typer's adapter for the same annotation."""

    __slots__ = ("convert", "label")

    def __init__(self, convert: Any, label: str) -> None:
        self.convert, self.label = convert, label

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        multiple = bool(getattr(param, "multiple", False)) or getattr(param, "nargs", 1) == -1
        if value is None:
            return () if multiple else None
        if multiple:
            return tuple(self._one(v, param, ctx) for v in value)
        return self._one(value, param, ctx)

    def _one(self, value: Any, param: Any, ctx: Any) -> Any:
        import typer

        try:
            return self.convert(value)
        except (ValueError, TypeError):
            raise typer.BadParameter(f"{value!r} is not {self.label}.", ctx=ctx, param=param) from None


def _choice(annotation: type[enum.Enum]) -> PlainParam:
    values = [member.value for member in annotation]

    def convert(value: Any) -> enum.Enum:
        return value if isinstance(value, annotation) else annotation(value)

    return PlainParam(convert, "one of " + ", ".join(repr(v) for v in values))


def plain_param(annotation: Any) -> PlainParam | None:
    """The plain converter for `annotation`, or None where typer's own is needed."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return plain_param(inner[0]) if len(inner) == 1 else None
    if annotation is Path:
        return PlainParam(lambda v: v if isinstance(v, Path) else Path(v), "a path")
    if annotation is bool:
        return PlainParam(_bool, "true or false")
    if annotation is str:
        return PlainParam(str, "a string")
    if annotation is float:
        return PlainParam(lambda v: float(v) if not isinstance(v, bool) else _refuse(v), "a number")
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _choice(annotation)
    return None


def _refuse(value: Any) -> Any:
    raise TypeError(value)


_BOOLS = {"1": True, "true": True, "t": True, "yes": True, "y": True, "on": True}
_BOOLS.update({"0": False, "false": False, "f": False, "no": False, "n": False, "off": False})


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return _BOOLS[str(value).strip().lower()] if str(value).strip().lower() in _BOOLS else _refuse(value)


def install_plain_params(command: Any) -> int:
    """Place plain converters in the parameters of `command` and its subcommands (and in each help
    option, made when a context first asks for it); how many were placed."""
    placed = sum(install_plain_params(sub) for sub in getattr(command, "commands", {}).values())
    placed += sum(_install(param) for param in getattr(command, "params", ()))
    original = getattr(command, "get_help_option", None)
    if callable(original):

        def get_help_option(ctx: Any) -> Any:
            option = original(ctx)
            if option is not None:
                _install(option)
            return option

        command.get_help_option = get_help_option
    return placed


def _install(param: Any) -> int:
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None or getattr(param, "_runtime_param", "absent") is not None:
        return 0  # not typer's lazy slot (or already filled): typer converts
    converter = plain_param(getattr(descriptor, "annotation", None))
    if converter is None:
        return 0
    param._runtime_param = converter
    return 1
