"""Tests of gradaudit.measure."""
