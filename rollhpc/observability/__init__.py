"""What a run leaves behind for people: metrics.jsonl, later TensorBoard and HDF5 rollouts."""
