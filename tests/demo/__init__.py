"""Tests of gradaudit.demo."""
