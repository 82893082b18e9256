"""Logical parameter names: the model's own FQNs with wrapper modules' path components removed."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence

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
    return zip(*logical_parameter_columns(model), strict=True)


def logical_parameter_columns(
    model: torch.nn.Module,
) -> tuple[list[str], list[str], list[torch.nn.Parameter]]:
    """The logical names, this rank's FQNs and the distinct parameters of `model`, in the order of
    `model.named_parameters()`: walked module by module as torch's own walk does, with a module's
    logical prefix found once (a rank may hold 10^5 parameters), unless the model overrides the walk."""
    logicals: list[str] = []
    fqns: list[str] = []
    params: list[torch.nn.Parameter] = []
    module_type = type(model)
    if (
        module_type.named_parameters is not torch.nn.Module.named_parameters
        or module_type.named_modules is not torch.nn.Module.named_modules
        or not {"named_parameters", "named_modules"}.isdisjoint(vars(model))
    ):
        for fqn, param in model.named_parameters():
            logicals.append(logical_name(model, fqn))
            fqns.append(fqn)
            params.append(param)
        return logicals, fqns, params
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        own = module._parameters
        values = list(own.values())
        ids = set(map(id, values))
        if len(ids) == len(values) and id(None) not in ids and ids.isdisjoint(seen):
            keys = list(own)
            seen |= ids
        else:  # a None, or a parameter listed twice: skipped after its first place, as torch does
            keys, values = [], []
            for key, value in own.items():
                if value is not None and id(value) not in seen:
                    seen.add(id(value))
                    keys.append(key)
                    values.append(value)
        if not keys:
            continue
        own_fqns = [f"{prefix}.{key}" for key in keys] if prefix else keys
        logical_prefix = logical_name(model, f"{prefix}._")[:-1] if prefix else ""
        fqns += own_fqns
        logicals += (
            own_fqns
            if not prefix or logical_prefix == f"{prefix}."
            else [logical_prefix + key for key in keys]
        )
        params += values
    return logicals, fqns, params


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
