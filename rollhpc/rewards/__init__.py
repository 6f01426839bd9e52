"""Rewards as parts: rule checks, math-verify, an LLM judge; each sample's reward is named components.

A reward function returns *components* (``{"math": 1.0, "judge": 0.5}``), not one float, so that a run
can log every part, weigh parts per domain (``combine``) and change the weights without re-scoring.
Modules here are pure logic and import no engine: the judge role that runs a model lives in
``rollhpc.workers.judge``.
"""

from rollhpc.rewards.components import Components, combine

__all__ = ["Components", "combine"]
