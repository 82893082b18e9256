"""Logical parameter names: the model's own FQNs with wrapper modules' path components removed."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WRAPPER_ATTRIBUTES = frozenset({"_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"})
"""Child names that FSDP1, torch.compile and activation checkpointing insert into parameter paths."""

_WRAPPER_PARTS = (*sorted(WRAPPER_ATTRIBUTES), "module")
_DDP_CLASS_NAMES = frozenset({"DistributedDataParallel", "DataParallel"})


def is_ddp(module: object) -> bool:
    return any(cls.__name__ in _DDP_CLASS_NAMES for cls in type(module).__mro__)


def logical_name(model: torch.nn.Module, fqn: str) -> str:
    """`fqn` (as model.named_parameters() gives it) without wrapper path components.

    `module.` is dropped only where the module holding it is a DistributedDataParallel wrapper, so a
    user's own submodule called `module` keeps its name.
    """
    if not any(part in fqn for part in _WRAPPER_PARTS):  # the common case, first (10^5 names a rank happen)
        return fqn
    parts = fqn.split(".")
    kept = []
    module: object = model
    for part in parts[:-1]:
        wrapper = part in WRAPPER_ATTRIBUTES or (part == "module" and is_ddp(module))
        if not wrapper:
            kept.append(part)
        module = getattr(module, part, None) if module is not None else None
    kept.append(parts[-1])
    return ".".join(kept)


def named_logical_parameters(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(logical name, this rank's FQN, parameter) for each distinct parameter of `model`."""
    for fqn, param in model.named_parameters():
        yield logical_name(model, fqn), fqn, param


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
