"""Tests of gradaudit.capture."""
