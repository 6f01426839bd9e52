"""Run state beside the weights: JSON written atomically, and every random number generator a rank uses.

``save_rng_states`` returns a plain picklable dict: python ``random``, numpy's global generator, torch's
CPU generator, any named ``numpy.random.Generator`` or ``torch.Generator`` passed in, and every CUDA
device's generator once this process has initialised CUDA (a process that never did, such as the
controller, is not made to create a CUDA context). ``restore_rng_states`` puts them back, so the draws
after a restore are the draws the saved run would have made. Each rank saves its own (``torch.save`` into the pending
checkpoint directory, e.g. ``rng/rank_00003.pt``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rollhpc.rundir import atomic_write_bytes

if TYPE_CHECKING:
    import torch


def save_json(path: str | Path, obj: object) -> None:
    """Write ``obj`` as JSON atomically (temp file, fsync, rename, fsync of the directory)."""
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=1) + "\n").encode())


def load_json(path: str | Path) -> object:
    return json.loads(Path(path).read_bytes())


def save_rng_states(
    generators: Mapping[str, np.random.Generator | torch.Generator] | None = None,
) -> dict[str, Any]:
    """The state of every generator a rank draws from, as a picklable dict."""
    # torch loads here, not at the top: the controller (rank 0) imports this module at start and needs torch
    # only at its first checkpoint, while its workers are still building
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    for name, gen in (generators or {}).items():
        if isinstance(gen, np.random.Generator):
            state["generators"][name] = ("numpy", gen.bit_generator.state)
        elif isinstance(gen, torch.Generator):
            state["generators"][name] = ("torch", gen.get_state())
        else:
            raise TypeError(
                f"generator {name!r}: expected numpy.random.Generator or torch.Generator, "
                f"got {type(gen).__name__}"
            )
    return state


def restore_rng_states(
    state: Mapping[str, Any],
    generators: Mapping[str, np.random.Generator | torch.Generator] | None = None,
) -> None:
    """Put back what ``save_rng_states`` returned; ``generators`` must have the names saved then."""
    import torch

    generators = dict(generators or {})
    saved = state.get("generators", {})
    if set(saved) != set(generators):
        raise ValueError(
            f"saved RNG states are for generators {sorted(saved)}, given {sorted(generators)}"
        )
    for name, (kind, _) in saved.items():
        if not isinstance(
            generators[name], np.random.Generator if kind == "numpy" else torch.Generator
        ):
            raise TypeError(
                f"generator {name!r} was saved as a {kind} generator, given "
                f"{type(generators[name]).__name__}"
            )
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if "cuda" in state and have != len(state["cuda"]):
        raise ValueError(
            f"saved CUDA RNG states for {len(state['cuda'])} device(s), this process sees {have}"
        )
    for name, (kind, gen_state) in saved.items():
        if kind == "numpy":
            generators[name].bit_generator.state = gen_state
        else:
            generators[name].set_state(gen_state)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
