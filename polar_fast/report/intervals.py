"""Bootstrap intervals over tasks: how far a pass@1, or a change in it, can be trusted.

A pass@1 is a mean over tasks of each task's share of passing samples; tasks, not samples, are
what a new draw of the benchmark would change, so the intervals resample tasks. A change between
two policies evaluated on the same tasks is paired: each task's difference is resampled, which
removes the spread of task difficulty from the interval.

A percentile bootstrap over a handful of tasks is too sure of itself: with 4 tasks of which 3
improved and none got worse it gives [+25, +100] points, although a policy that changed nothing
moves 3 of 3 changed tasks the same way one time in four. A verdict (a gain, a loss, within noise)
therefore also takes the paired sign-flip test, `sign_flip_p`, which holds at any number of tasks:
under no change, each task's difference is as likely with either sign (every pattern is counted
up to 16 changed tasks, random ones past that).
"""

from __future__ import annotations

import random
from typing import Sequence

import numpy as np

EXACT_UP_TO = 16  # changed tasks: every sign pattern (2^16) is enumerated; past that, random ones


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


def sign_flip_p(diffs: Sequence[float], *, draws: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of "mean(diffs) = 0" by the paired sign-flip (permutation) test: the share
    of the 2^m sign patterns of the m non-zero differences whose sum is at least as far from 0 as
    the observed one. Exact up to EXACT_UP_TO changed tasks; past that, estimated from `draws`
    seeded random patterns (the observed one counted in, so p is never 0). 1.0 when no task changed."""
    d = np.array([x for x in diffs if x != 0], dtype=np.float64)
    if d.size == 0:
        return 1.0
    observed = abs(d.sum()) - 1e-9 * np.abs(d).sum()  # a pattern as extreme up to rounding counts
    if d.size <= EXACT_UP_TO:
        patterns = np.arange(2 ** d.size, dtype=np.int64)[:, None] >> np.arange(d.size) & 1  # (2^m, m) 0/1
        sums = np.where(patterns == 1, d, -d).sum(axis=1)
        return float(np.mean(np.abs(sums) >= observed))
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(draws, d.size))
    return float((1 + np.sum(np.abs(signs @ d) >= observed)) / (1 + draws))


def paired_verdict(before: Sequence[float], after: Sequence[float]) -> tuple[float, float, float, str]:
    """(lo, hi, p, verdict) for a paired change: the 95% bootstrap interval, the sign-flip p-value,
    and "a gain" or "a loss" only when the interval excludes 0 and p < 0.05, else "within noise"."""
    lo, hi = paired_bootstrap(before, after)
    p = sign_flip_p([a - b for a, b in zip(after, before)])
    if p < 0.05 and lo > 0:
        return lo, hi, p, "a gain"
    if p < 0.05 and hi < 0:
        return lo, hi, p, "a loss"
    return lo, hi, p, "within noise"
