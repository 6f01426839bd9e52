"""Inference and training engines behind small interfaces; heavy imports stay inside."""
