"""Hostile input: a corpus of broken dumps, fuzzing, and safety tests."""
