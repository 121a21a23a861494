"""Attention for the embedded engine's batched steps: every call sees only its own keys.

One engine step forwards one packed row of tokens taken from several calls: a decode token of
each running call and a chunk of a joining call's prompt. Every linear layer then reads its
weights once for the whole batch, which is what makes a batch cheaper than its calls one by one
on a CPU, where a decode step is bound by reading the weights. Attention is the one place where
the calls must stay apart. This function, registered with transformers' AttentionInterface
under NAME, writes each call's new keys and values into that call's own cache (`CallKV`) and runs
SDPA per call over its cache, so a call's numbers never mix with its batch-mates'.

The caches are ours, not transformers' `DynamicCache`: a call joins and leaves the batch at any
step, and a cache per call that grows in place (capacity doubles) needs no re-stacking when the
batch changes. The step's plan (`StepPlan`) reaches the function as the `step_plan` keyword,
which transformers passes through to the attention function untouched; the engine advances each
cache's length once the whole forward is done (`StepPlan.commit`), because every layer writes at
the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "polar_fast_batched_decode"


class CallKV:
    """One call's keys and values for every layer: `data` is (layers, 2, kv_heads, capacity,
    head_dim), of which the first `length` positions are filled."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256) -> None:
        self.data = torch.empty(n_layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, config: Any, *, dtype: torch.dtype, device: torch.device | str,
                  capacity: int = 256) -> CallKV:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype=dtype, device=device,
                   capacity=capacity)

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def reserve(self, n: int) -> None:
        """Room for `n` positions in all (doubling, so appends cost O(1) amortised)."""
        if n <= self.capacity:
            return
        grown = self.data.new_empty(*self.data.shape[:3], max(n, 2 * self.capacity), self.data.shape[4])
        grown[:, :, :, : self.length] = self.data[:, :, :, : self.length]
        self.data = grown

    def copy_prefix(self, n: int) -> CallKV:
        """A private copy holding the first `n` positions (prefix_cache.PrefixCache.take)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"copy_prefix({n}) of a cache holding {self.length} positions")
        mine = CallKV.__new__(CallKV)
        mine.data = self.data.new_empty(*self.data.shape[:3], max(n, 1) + 256, self.data.shape[4])
        mine.data[:, :, :, :n] = self.data[:, :, :, :n]
        mine.length = n
        return mine

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True, eq=False)
class Segment:
    """The packed rows [start, stop) are one call's next tokens, at positions kv.length onwards."""

    kv: CallKV
    start: int
    stop: int

    @property
    def n(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, eq=False)
class StepPlan:
    segments: list[Segment]
    masks: list[torch.Tensor | None]  # per segment: (L, past + L) bool, or None (decode, or no past)

    @classmethod
    def of(cls, segments: list[Segment], device: torch.device | str) -> StepPlan:
        for s in segments:
            s.kv.reserve(s.kv.length + s.n)
        return cls(segments, [_chunk_mask(s, device) for s in segments])

    def commit(self) -> None:
        """After the forward: every layer has written the segments' keys and values."""
        for s in self.segments:
            s.kv.length += s.n


def _chunk_mask(s: Segment, device: torch.device | str) -> torch.Tensor | None:
    # One query sees all it has; a chunk with no past is plain causal (SDPA's is_causal). Only a
    # chunk after a past needs a mask, because SDPA's is_causal aligns to the top-left corner.
    if s.n == 1 or s.kv.length == 0:
        return None
    past = s.kv.length
    q = torch.arange(s.n, device=device)[:, None]
    k = torch.arange(past + s.n, device=device)[None, :]
    return k <= past + q


def batched_decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, H_kv, T, D)
    value: torch.Tensor,  # (1, H_kv, T, D)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    step_plan: StepPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # (1, T, H, D)
    if step_plan is None:
        raise ValueError(f"{NAME} needs a step_plan (the embedded engine passes one)")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(f"{NAME} does not support softcap or sliding-window attention")
    layer = module.layer_idx
    outs = []
    for s, mask in zip(step_plan.segments, step_plan.masks):
        past, total = s.kv.length, s.kv.length + s.n
        cache = s.kv.data[layer]  # (2, H_kv, capacity, D)
        cache[0, :, past:total] = key[0, :, s.start : s.stop]
        cache[1, :, past:total] = value[0, :, s.start : s.stop]
        out = F.scaled_dot_product_attention(
            query[:, :, s.start : s.stop], cache[0, None, :, :total], cache[1, None, :, :total],
            attn_mask=mask, is_causal=mask is None and s.n > 1, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # (1, H, L, D)
        outs.append(out)
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, batched_decode_attention)
