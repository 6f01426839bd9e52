"""What a run leaves behind for people: metrics.jsonl, TensorBoard scalars in tb/, HDF5 rollouts (RunLog owns all three)."""
