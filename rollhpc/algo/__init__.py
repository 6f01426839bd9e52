"""Advantages and losses: small pure functions, each unit-tested against hand-computed values."""
