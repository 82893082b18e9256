"""Tests of the command line: gradaudit.cli, its options, exit codes, signals and start-up."""
