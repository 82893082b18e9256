"""Tests of gradaudit.analysis."""
