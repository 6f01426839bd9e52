"""The quickstart task: given digits a and b, answer (a + b) mod m with a single token.

Small enough that a policy learns it in a minute on a CPU, and verifiable exactly, so the reward
is a rule and accuracy on all m*m prompts is an honest measure of progress.
"""

from __future__ import annotations

import numpy as np


def all_prompts(modulus: int) -> np.ndarray:
    """Every (a, b) pair, shape [modulus**2, 2]."""
    a, b = np.meshgrid(np.arange(modulus), np.arange(modulus), indexing="ij")
    return np.stack([a.ravel(), b.ravel()], axis=1).astype(np.int64)


def sample_prompts(rng: np.random.Generator, modulus: int, n: int) -> np.ndarray:
    return rng.integers(0, modulus, size=(n, 2), dtype=np.int64)


def reward(prompts: np.ndarray, answers: np.ndarray, modulus: int) -> np.ndarray:
    """1.0 where answer == (a + b) mod modulus, else 0.0."""
    return ((prompts[:, 0] + prompts[:, 1]) % modulus == answers).astype(np.float32)
