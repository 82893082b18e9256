"""Tests of gradaudit.live: the guard, its trend file and the reports of a guarded run."""
