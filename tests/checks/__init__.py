"""Tests of gradaudit.checks: one finding code family at a time, and the committed samples."""
