"""The always-on guard: a live check of every training step's clipping (`gradaudit.guard`)."""
