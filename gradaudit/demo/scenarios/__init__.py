"""One module per demo scenario; each defines `train_rank(ctx)` and `train_reference(out_dir)`."""
