"""gradaudit: audit gradient clipping under sharded training.

`import gradaudit` stays light: torch and the capture code load on first use of the capture API.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AuditStep", "Guard", "__version__", "audit_step", "begin_audit", "dump", "guard", "run_reference"]


_HOMES = {
    **dict.fromkeys(("AuditStep", "audit_step", "begin_audit", "dump"), "capture.session"),
    **dict.fromkeys(("guard", "Guard"), "live.guard"),
    "run_reference": "capture.reference_run",
    "__version__": "version",
}
"""Each public name -> the module (under this package) that defines it, imported on first use."""


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'gradaudit' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
