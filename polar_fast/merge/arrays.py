"""The merge's output types: `Merged` (one group) and `MicroBatch` (one packed batch).

Array contract, shared by `Merged` and `MicroBatch` (T tokens, P sequences, E extra samples):
    tokens     int32 (T,)    token ids
    positions  int32 (T,)    position id = depth below the sequence root
    parent     int32 (T,)    index of the parent token in these arrays, -1 at a sequence root
    size       int32 (T,)    tokens in the subtree rooted here; q may attend k iff
                             k <= q < k + size[k] (a plain path gives ordinary causal attention)
    loss_mask  uint8 (T,)    1 = a sampled token whose loss is taken here (once over all outputs)
    logprobs   float32 (T,)  behaviour logprob where loss_mask, else 0
    versions   int32 (T,)    policy version that sampled it where loss_mask, else -1
    rollout    int32 (T,)    index into rollout_ids: the sampler where loss_mask
    node       int32 (T,)    trie node id (a node repeated across paths keeps its id)
    offsets    int32 (P+1,)  sequence boundaries
    extra_*    (E,)          further samples of an already-masked token: extra_index (position),
                             extra_rollout, extra_version (int32), extra_logprob (float32); each is
                             one more loss term, so no rollout's sample is ever dropped
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import msgspec
import numpy as np

from polar_fast.config import LAYOUTS, Layout

__all__ = ["ARRAY_FIELDS", "EXTRA_FIELDS", "LAYOUTS", "TOKEN_FIELDS", "Layout", "MergeStats", "Merged",
           "MicroBatch", "PackPlan", "TokenArrays", "gather"]


class MergeStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counts of one merge. Break causes: see merge/reference.py."""

    n_calls: int
    n_rollouts: int
    n_nodes: int  # distinct trie nodes = tokens the tree layout computes
    n_output_tokens: int  # tokens in this layout's arrays
    n_call_tokens: int  # sum of prompt+completion over calls = tokens per-call training computes
    n_samples: int  # sampled tokens over all calls
    n_extra_samples: int
    n_leaves: int
    extend: int
    new_root: int
    in_completion: int
    in_prompt: int
    completion_fork: int
    duplicate: int

    @property
    def n_breaks(self) -> int:
        return self.new_root + self.in_completion + self.in_prompt


@dataclass(frozen=True, eq=False, kw_only=True)
class TokenArrays:
    """The per-token arrays (and extras) that `Merged` and `MicroBatch` share; see above."""

    tokens: np.ndarray
    positions: np.ndarray
    parent: np.ndarray
    size: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    rollout: np.ndarray
    node: np.ndarray
    offsets: np.ndarray
    extra_index: np.ndarray
    extra_rollout: np.ndarray
    extra_logprob: np.ndarray
    extra_version: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


# The array names, defined once by TokenArrays above, in the order the Rust extension returns
# them (tests/test_merge_stub_and_bench.py checks lib.rs and _native.pyi against these).
ARRAY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TokenArrays))
TOKEN_FIELDS = ARRAY_FIELDS[: ARRAY_FIELDS.index("offsets")]  # one entry per token (T,)
EXTRA_FIELDS = tuple(name for name in ARRAY_FIELDS if name.startswith("extra_"))  # one per extra sample (E,)


@dataclass(frozen=True, eq=False, kw_only=True)
class Merged(TokenArrays):
    """One group's calls merged; indices in `rollout` refer to `rollout_ids`."""

    layout: Layout
    rollout_ids: list[str]
    stats: MergeStats


@dataclass(frozen=True, eq=False)
class PackPlan:
    """Where one micro-batch's tokens come from: positions in `Merged` plus local structure."""

    index: np.ndarray  # int32 (T,) positions in the Merged arrays
    parent: np.ndarray  # int32 (T,) local
    size: np.ndarray  # int32 (T,) local
    loss_mask: np.ndarray  # uint8 (T,) merged mask, zeroed where a repeated token was owned earlier
    offsets: np.ndarray  # int32 (P+1,) local sequence boundaries
    extra_ids: np.ndarray  # int32 (E,) rows of Merged's extra_* arrays
    extra_index: np.ndarray  # int32 (E,) local positions of those extras


@dataclass(frozen=True, eq=False, kw_only=True)
class MicroBatch(TokenArrays):
    """One packed batch of at most `max_tokens` tokens; `rollout` indexes its Merged's rollout_ids."""


def gather(merged: Merged, plan: PackPlan) -> MicroBatch:
    """Materialise one micro-batch from its plan (numpy fancy indexing)."""
    i = plan.index
    owned = plan.loss_mask.astype(bool)
    return MicroBatch(
        tokens=merged.tokens[i],
        positions=merged.positions[i],
        parent=plan.parent,
        size=plan.size,
        loss_mask=plan.loss_mask,
        logprobs=np.where(owned, merged.logprobs[i], np.float32(0)),
        versions=np.where(owned, merged.versions[i], np.int32(-1)),
        rollout=merged.rollout[i],
        node=merged.node[i],
        offsets=plan.offsets,
        extra_index=plan.extra_index,
        extra_rollout=merged.extra_rollout[plan.extra_ids],
        extra_logprob=merged.extra_logprob[plan.extra_ids],
        extra_version=merged.extra_version[plan.extra_ids],
    )


