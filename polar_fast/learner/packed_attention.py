"""Packed attention on SDPA kernels without a (T, T) mask: the learner's attention off FlexAttention.

The rule is packed_forward's (query q may attend key k iff k <= q < k + size[k]); a dense mask
of it makes SDPA compute all T x T scores, most of them masked: the other sequences of a
`paths` batch, the sibling branches of a `tree`. Instead the packed tokens are cut into runs
(maximal chains in which each token is the previous one's only child), and attention is
computed per block of consecutive queries against only the keys the block can see: the
ancestors of its first token plus the block itself. A block that is one whole root run (a
`paths` sequence, a per-call sequence, the trunk of a tree) is plain causal attention with no
mask at all, what a one-sequence trainer runs; other blocks get a small (L, K) additive mask.
Long branches are cut into blocks of BLOCK_TOKENS queries so that the causal part inside a
branch is not computed in full; short runs are merged into one block so that a bushy tree
does not cost one kernel call per token.

The plan is built once per micro-batch from `size` (numpy, on the host) and handed to every
layer as the `packed_plan` keyword, which transformers passes through to the attention
function; masks are made once there, in the weights' dtype, not converted by every layer. Each
layer gathers the keys of all blocks with one index_select and splits queries, keys and values
once, so the backward is one scatter and a few concatenations, not a (T, ...) zero gradient per
block. The function is registered under NAME; set_attn_implementation(NAME) selects it.
Without a plan it is plain SDPA on the 4D mask it is given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "polar_fast_packed_sdpa"
BLOCK_TOKENS = 256  # queries per block cut from a long branch
MERGE_TOKENS = 32  # runs shorter than this are merged with their neighbours


@dataclass(frozen=True, eq=False)
class Plan:
    """Attention calls over consecutive query blocks; every list has one entry per block."""

    sizes: list[int]  # queries per block, in order, summing to T
    key_index: torch.Tensor | None  # (sum of key_sizes,) long: each block's keys in turn; None: the queries
    key_sizes: list[int]
    masks: list[torch.Tensor | None]  # (L, K) additive, 0 or -inf; None: causal, the keys are the queries


def plan(size: torch.Tensor, dtype: torch.dtype = torch.float32, block_tokens: int | None = None,
         merge_tokens: int | None = None) -> Plan:
    """The plan of one packed micro-batch, masks in `dtype`. Defaults BLOCK_TOKENS, MERGE_TOKENS."""
    block_tokens, merge_tokens = block_tokens or BLOCK_TOKENS, merge_tokens or MERGE_TOKENS
    s = size.cpu().numpy().astype(np.int64)
    t = len(s)
    idx = np.arange(t)
    end = idx + s  # a token's subtree is [k, end[k])
    # k continues k - 1's run iff k is k - 1's only child (in DFS order k - 1 is then its parent)
    starts = np.flatnonzero(np.r_[True, s[:-1] != s[1:] + 1]) if t else np.zeros(0, np.int64)
    stops = np.r_[starts[1:], t]
    reach = np.maximum.accumulate(end) if t else end  # furthest subtree end among tokens <= k
    pieces = []  # (start, stop, is a whole root run)
    for a, b in zip(starts.tolist(), stops.tolist()):
        if a == 0 or reach[a - 1] <= a:
            pieces.append((a, b, True))
        else:
            pieces.extend((p, min(p + block_tokens, b), False) for p in range(a, b, block_tokens))
    sizes, keys, masks = [], [], []
    i = 0  # merge a short piece with its neighbours, up to block_tokens queries
    while i < len(pieces):
        a, b, root = pieces[i]
        i += 1
        while i < len(pieces) and pieces[i][1] - a <= block_tokens \
                and min(b - a, pieces[i][1] - pieces[i][0]) < merge_tokens:
            b, root, i = pieces[i][1], False, i + 1
        k = idx[a:b] if root else np.r_[np.flatnonzero(end[:a] > a), idx[a:b]]  # ancestors of a, the block
        q = idx[a:b, None]
        sizes.append(b - a)
        keys.append(k)
        masks.append(None if root else _additive((k <= q) & (q < end[k]), dtype, size.device))
    key_index = np.concatenate(keys) if keys else idx
    if np.array_equal(key_index, idx):
        return Plan(sizes, None, sizes, masks)
    return Plan(sizes, torch.from_numpy(key_index).to(size.device), [len(k) for k in keys], masks)


def _additive(allowed: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where allowed, -inf elsewhere: what SDPA turns a boolean mask into, done once."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(torch.from_numpy(~allowed), float("-inf"))
    return mask.to(device)


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, H_kv, T, D)
    value: torch.Tensor,  # (1, H_kv, T, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_plan: Plan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # (1, T, H, D)
    if packed_plan is None:
        if attention_mask is None:
            raise ValueError(f"{NAME} needs a packed_plan (PackedLM passes one) or a 4D attention mask")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{NAME} does not support softcap; use eager or flex_attention")
    p = packed_plan
    if p.key_index is not None:
        key, value = key.index_select(2, p.key_index), value.index_select(2, p.key_index)
    rep = query.shape[1] // key.shape[1]
    outs = []
    for q, k, v, mask in zip(query.split(p.sizes, 2), key.split(p.key_sizes, 2), value.split(p.key_sizes, 2),
                             p.masks):
        if rep > 1 and mask is not None and q.device.type != "cpu":  # CUDA kernels take gqa only unmasked
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                             scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
        outs.append(out.transpose(1, 2))
    return (torch.cat(outs, 1) if len(outs) > 1 else outs[0].contiguous()), None


AttentionInterface.register(NAME, packed_sdpa_attention)
