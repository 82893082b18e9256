"""gradaudit.testing: clipping parity and multi-rank tests in your own test suite, on CPU gloo ranks.

    from gradaudit.testing import check_clip_parity

Light to import (the pytest plugin imports it in every pytest run): torch loads when a check runs.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ClipNotSeen",
    "NotSendableError",
    "ParityFailure",
    "RankFailure",
    "RankOutcome",
    "check_clip_parity",
    "launch",
    "run_ranks",
    "sgd",
]

_PARITY = ("ClipNotSeen", "ParityFailure", "check_clip_parity", "sgd")
_RANKS = ("NotSendableError", "RankFailure", "RankOutcome", "launch", "run_ranks")


def __getattr__(name: str) -> Any:
    if name in _PARITY:
        from . import parity

        return getattr(parity, name)
    if name in _RANKS:
        from .. import localranks

        return getattr(localranks, name)
    raise AttributeError(f"module 'gradaudit.testing' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
