"""Packed step batches: what one optimizer step trains on, and the parts every objective shares.

`StepBatch` holds, per micro-batch, the packed tokens (merge/arrays.py `MicroBatch`), the loss
terms (packed_forward.loss_terms), the advantage and aggregation weight of each term. Three
layouts: `tree` and `paths` are the merge's (config.LAYOUTS), `percall` is the baseline that
forwards every call as its own sequence. `group_batches` packs one group's calls in any of them.

GRPO builds its batch from finished groups (grpo.build_step_batch: advantages, then these parts);
supervised fine-tuning builds one from token rows here (`nll_step_batch`, learner/sft.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from polar_fast import merge
from polar_fast.config import LAYOUTS as MERGE_LAYOUTS
from polar_fast.learner import losses
from polar_fast.learner.packed_forward import Terms, loss_terms
from polar_fast.merge.arrays import MicroBatch
from polar_fast.records import CallRecord

LAYOUTS = (*MERGE_LAYOUTS, "percall")  # the merge's layouts, and one sequence per call (the baseline)


@dataclass(frozen=True, eq=False)
class StepBatch:
    """Everything one optimizer step trains on. Lists are per micro-batch; arrays per term."""

    micro_batches: list[MicroBatch]
    terms: list[Terms]
    advantages: list[np.ndarray]  # float32 (N,)
    weights: list[np.ndarray]  # float64 (N,): aggregation weights, summing to 1 over the step
    keys_rollout: list[np.ndarray]  # int64 (N,): global rollout index (per-rollout key)
    n_rollouts: int
    reward_mean: float

    @property
    def n_terms(self) -> int:
        return sum(len(t.position) for t in self.terms)

    @property
    def n_tokens(self) -> int:
        return sum(len(mb.tokens) for mb in self.micro_batches)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")


def percall_batches(calls: Sequence[CallRecord]) -> list[MicroBatch]:
    """The per-call baseline: each call its own sequence and micro-batch, no merging."""
    out = []
    for c in calls:
        n_p, n = len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)
        mask = np.zeros(n, np.uint8)
        mask[n_p:] = 1
        logprobs = np.zeros(n, np.float32)
        logprobs[n_p:] = c.completion_logprobs
        out.append(MicroBatch(
            tokens=np.array(c.prompt_ids + c.completion_ids, np.int32),
            positions=np.arange(n, dtype=np.int32),
            parent=np.arange(-1, n - 1, dtype=np.int32),
            size=np.arange(n, 0, -1, dtype=np.int32),
            loss_mask=mask,
            logprobs=logprobs,
            versions=np.where(mask == 1, c.policy_version, -1).astype(np.int32),
            rollout=np.zeros(n, np.int32),
            node=np.arange(n, dtype=np.int32),
            offsets=np.array([0, n], np.int32),
            extra_index=np.zeros(0, np.int32), extra_rollout=np.zeros(0, np.int32),
            extra_logprob=np.zeros(0, np.float32), extra_version=np.zeros(0, np.int32),
        ))
    return out


def group_batches(calls: list[CallRecord], layout: str, max_tokens: int,
                  merge_impl: merge.Impl) -> list[tuple[MicroBatch, list[str]]]:
    """(micro-batch, rollout_ids its `rollout` indexes into) for one group's calls."""
    if layout == "percall":
        return [(mb, [c.rollout_id]) for mb, c in zip(percall_batches(calls), calls)]
    merged = merge.merge(calls, layout=layout, impl=merge_impl)
    return [(mb, merged.rollout_ids) for mb in merge.pack(merged, max_tokens=max_tokens, impl=merge_impl)]


def split_weights(mode: str, keys_r: list[np.ndarray], keys_s: list[np.ndarray]) -> list[np.ndarray]:
    """Aggregation weights over the whole step, cut back into per-micro-batch pieces."""
    if not keys_r:
        return []
    keys = losses.aggregation_keys(mode, torch.from_numpy(np.concatenate(keys_r)),
                                   torch.from_numpy(np.concatenate(keys_s)))
    flat = losses.mean_of_means_weights(keys).numpy()
    return np.split(flat, np.cumsum([len(k) for k in keys_r])[:-1])


def nll_step_batch(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]], *, layout: str = "tree", max_tokens: int = 8192,
    merge_impl: merge.Impl = "rust",
) -> StepBatch:
    """Supervised fine-tuning on token rows (input_ids, loss_mask), as `export` writes them: every
    masked token one term, all terms weighted the same (token mean). Each row's masked runs become
    the calls they were sampled as (prompt = all before the run), and the rows are merged like a
    GRPO group, so the system prompt they share is forwarded once per micro-batch, not once per
    row. Train it with `Learner.train_step(batch, objective="nll")` (grpo.py)."""
    check_layout(layout)
    calls = []
    for r, (ids, mask) in enumerate(rows):
        if len(mask) != len(ids):
            raise ValueError(f"a token row has {len(ids)} input_ids but {len(mask)} loss_mask entries")
        ids, mask = list(ids), [int(m) for m in mask]
        for j, (start, end) in enumerate(_masked_runs(mask)):
            calls.append(CallRecord(
                session_id=f"row{r}", rollout_id=f"row{r:08d}", group_id="sft", call_index=j,
                prompt_ids=ids[:start], completion_ids=ids[start:end], completion_logprobs=[0.0] * (end - start),
                policy_version=0, finish_reason="stop", dialect="chat"))
    mbs = [mb for mb, _ in group_batches(calls, layout, max_tokens, merge_impl)] if calls else []
    terms = [loss_terms(mb) for mb in mbs]
    total = sum(len(t.position) for t in terms)
    weights = [np.full(len(t.position), 1.0 / total if total else 0.0) for t in terms]
    return StepBatch(mbs, terms, [np.ones(len(t.position), np.float32) for t in terms], weights,
                     [t.rollout.astype(np.int64) for t in terms], n_rollouts=len(rows), reward_mean=math.nan)


def _masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s (a run at position 0 has no prompt to condition on: skipped)."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            if start > 0:
                runs.append((start, i))
            start = None
    return runs
