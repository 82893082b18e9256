"""The numeric engine: reading dumped tensors (numpy, no torch), reducing them to float64
statistics, comparing with a reference, and splitting the work over processes."""
