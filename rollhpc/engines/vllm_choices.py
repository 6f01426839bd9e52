"""What the speed options of a vLLM engine (``enforce_eager``, ``seeded_sampling``, ``engine_process``) come to on
a platform, their "auto" resolved.

A module of its own, free of vLLM and torch: the engine config (``rollhpc.engines.config``, validated at load) and
the engine (``rollhpc.engines.vllm_engine``) both read it, and the config imports the engine lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AutoBool", "EngineProcess", "VllmChoices", "resolve_vllm_choices"]

# A Literal, not ``bool | Literal["auto"]``: the config loader names a Literal's values in its one-line error
# ("'yes' is not one of ['auto', True, False]"). It also lets 1 and 0 through (they equal True and False), which
# resolve_vllm_choices refuses.
AutoBool = Literal["auto", True, False]
EngineProcess = Literal["auto", "same", "separate"]


@dataclass(frozen=True)
class VllmChoices:
    """What the "auto" defaults of a vLLM engine's speed options come to on one platform (logged at start)."""

    enforce_eager: bool  # no torch.compile, no CUDA graphs
    seeded_sampling: bool  # requests keep their seeds (one torch.Generator each in vLLM's sampler)
    separate_process: (
        bool  # the engine core in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1)
    )


def resolve_vllm_choices(
    on_cpu: bool,
    enforce_eager: AutoBool = "auto",
    seeded_sampling: AutoBool = "auto",
    engine_process: EngineProcess = "auto",
) -> VllmChoices:
    """Each "auto" as the platform wants it: the CPU keeps what its tests and exact resume rely on (eager, seeded,
    one process); a GPU gets speed (CUDA graphs, no per-request generators, the engine core off this GIL).
    Kept free of vLLM so that the choice is testable and plannable without it."""
    for key, value in (("enforce_eager", enforce_eager), ("seeded_sampling", seeded_sampling)):
        if not (isinstance(value, bool) or value == "auto"):
            raise ValueError(f"{key}: true, false or 'auto', got {value!r}")
    if engine_process not in ("auto", "same", "separate"):
        raise ValueError(f"engine_process: 'auto', 'same' or 'separate', got {engine_process!r}")
    return VllmChoices(
        enforce_eager=on_cpu if enforce_eager == "auto" else bool(enforce_eager),
        seeded_sampling=on_cpu if seeded_sampling == "auto" else bool(seeded_sampling),
        separate_process=(not on_cpu) if engine_process == "auto" else engine_process == "separate",
    )
