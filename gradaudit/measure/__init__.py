"""Measure: reading the dumped tensors once (numpy, no torch) into float64 statistics per piece,
replica comparisons and the comparison with a reference (`measure.measure_step` -> StepMeasurements)."""
