"""Tests of gradaudit.dumpfile."""
