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
    """``sum(weights[k] * components[k])`` over the weighted names.

    A weighted component that is missing is an error, never a silent 0 (a misspelt name in the config
    would otherwise train on a reward that lacks a part). Components without a weight are left out:
    they are logged, not trained on. Non-finite values are errors too.
    """
    if not weights:
        raise ValueError("combine() needs at least one weight")
    missing = sorted(set(weights) - set(components))
    if missing:
        raise ValueError(f"reward component(s) {', '.join(missing)} missing: the sample has "
                         f"{', '.join(sorted(components)) or 'none'}")
    total = 0.0
    for name, weight in weights.items():
        value = float(components[name])
        if not (math.isfinite(value) and math.isfinite(weight)):
            raise ValueError(f"reward component {name!r} = {value} with weight {weight}: both must be finite")
        total += weight * value
    return total
