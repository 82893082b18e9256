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
        """A parameter taking several values is annotated as a list or tuple, which `plain_param` leaves
        to typer: here every value is one value, or None."""
        import typer

        if value is None:
            return None
        try:
            return self.convert(value)
        except (ValueError, TypeError):
            raise typer.BadParameter(f"{value!r} is not {self.label}.", ctx=ctx, param=param) from None


def plain_param(annotation: Any) -> PlainParam | None:
    """The plain converter for `annotation`, or None where typer's own is needed."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return plain_param(inner[0]) if len(inner) == 1 else None
    if annotation is Path:
        return PlainParam(lambda v: v if isinstance(v, Path) else Path(v), "a path")
    if annotation is bool:  # a flag's value: a bool, which typer passes by, or None when not given
        return PlainParam(lambda v: v if isinstance(v, bool) else _refuse(v), "true or false")
    if annotation is str:
        return PlainParam(str, "a string")
    if annotation is float:
        return PlainParam(lambda v: float(v) if not isinstance(v, bool) else _refuse(v), "a number")
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return PlainParam(
            lambda v: v if isinstance(v, annotation) else annotation(v),
            "one of " + ", ".join(repr(member.value) for member in annotation),
        )
    return None


def _refuse(value: Any) -> Any:
    raise TypeError(value)


def install_plain_params(command: Any) -> None:
    """Place plain converters in the parameters of `command` and its subcommands (and in each help
    option, made when a context first asks for it)."""
    for sub in getattr(command, "commands", {}).values():
        install_plain_params(sub)
    for param in getattr(command, "params", ()):
        _install(param)
    original = getattr(command, "get_help_option", None)
    if callable(original):

        def get_help_option(ctx: Any) -> Any:
            option = original(ctx)
            if option is not None:
                _install(option)
            return option

        command.get_help_option = get_help_option


def _install(param: Any) -> None:
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None or getattr(param, "_runtime_param", "absent") is not None:
        return  # not typer's lazy slot (or already filled): typer converts
    converter = plain_param(getattr(descriptor, "annotation", None))
    if converter is not None:
        param._runtime_param = converter
