"""Why one parameter could not be captured (warned about; the rest of the step is still dumped)."""

from __future__ import annotations


class UnsupportedParameter(Exception):
    """A parameter whose layout the capture cannot describe; the message says which and why."""
