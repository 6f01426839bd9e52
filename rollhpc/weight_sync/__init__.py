"""Weights from the trainer to the generators: bucketed, versioned."""
