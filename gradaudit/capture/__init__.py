"""Capture inside training: ownership inference per stack, the audit_step hook, the dump writer glue."""

from .ownership import LocalPiece

__all__ = ["LocalPiece"]
