"""Renderers: each turns a report value into a string; the CLI decides where it goes."""
