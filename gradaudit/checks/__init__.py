"""The checks: one module per family of finding codes, registered in `registry.CHECKS`."""
