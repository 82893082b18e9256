"""Analysis: what the measured numbers mean (the diagnosis of the clip norm, the geometry of the
pieces, the update judgements); pure functions of loaded and measured values."""
