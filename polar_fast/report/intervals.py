"""Bootstrap intervals over tasks: how far a pass@1, or a change in it, can be trusted.

A pass@1 is a mean over tasks of each task's share of passing samples; tasks, not samples, are
what a new draw of the benchmark would change, so the intervals resample tasks. A change between
two policies evaluated on the same tasks is paired: each task's difference is resampled, which
removes the spread of task difficulty from the interval.
"""

from __future__ import annotations

import random
from typing import Sequence


def bootstrap(values: Sequence[float], *, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(values), resampling them with replacement."""
    if not values:
        return 0.0, 0.0
    rng = random.Random(seed)
    values = list(values)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def paired_bootstrap(before: Sequence[float], after: Sequence[float], *, draws: int = 4000,
                     seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(after - before) over paired tasks, resampling tasks with replacement."""
    if len(before) != len(after):
        raise ValueError(f"paired_bootstrap: {len(before)} tasks before but {len(after)} after")
    return bootstrap([a - b for a, b in zip(after, before)], draws=draws, seed=seed)
