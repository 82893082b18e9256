"""gradaudit: audit gradient clipping under sharded training.

`import gradaudit` stays light: torch and the capture code load on first use of the capture API.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AuditStep", "__version__", "audit_step", "begin_audit", "dump", "run_reference"]


def __getattr__(name: str) -> Any:
    if name in ("AuditStep", "audit_step", "begin_audit", "dump"):
        from .capture import session

        return getattr(session, name)
    if name == "run_reference":
        from .capture.reference_run import run_reference

        return run_reference
    if name == "__version__":
        from .version import __version__

        return __version__
    raise AttributeError(f"module 'gradaudit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
