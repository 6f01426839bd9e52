"""One sample's reward as named components, and their weighted sum.

Why components: a multi-domain run scores math with a verifier, chat with a judge and both with a format
check; keeping the parts apart lets the run log each one, and lets a domain's weights change in the
config without any scorer knowing about the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["Components", "combine"]

Components = dict[str, float]  # one sample's reward parts by name, e.g. {"math": 1.0, "judge": 0.5}


def combine(components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """``sum(weight * value)`` over every component, a component's weight being 1 unless ``weights`` names it
    (weight 0: logged, not trained on). So one role's reward needs no weights at all.

    A weight for a component no role returned is an error, never a silent 0 (a misspelt name in the config
    would otherwise train on a reward that lacks a part). Non-finite values are errors too.
    """
    missing = sorted(set(weights) - set(components))
    if missing:
        raise ValueError(
            f"reward weights name component(s) {', '.join(missing)} that no reward role returned: "
            f"the sample has {', '.join(sorted(components)) or 'none'}"
        )
    total = 0.0
    for name, value in components.items():
        weight = float(weights.get(name, 1.0))
        value = float(value)
        if not (math.isfinite(value) and math.isfinite(weight)):
            raise ValueError(
                f"reward component {name!r} = {value} with weight {weight}: both must be finite"
            )
        total += weight * value
    return total
