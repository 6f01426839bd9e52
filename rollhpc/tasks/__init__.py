"""Synthetic tasks with verifiable answers, generated locally (nothing is downloaded)."""
