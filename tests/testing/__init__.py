"""Tests of gradaudit.testing: clip parity and the pytest plugin."""
