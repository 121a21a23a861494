"""Attention for the embedded engine's batched steps: every call sees only its own keys, and a
prefix that several calls share is read once for all of them.

One engine step forwards one packed row of tokens taken from several calls: a decode token of
each running call and a chunk of a joining call's prompt. Every linear layer then reads its
weights once for the whole batch. Attention is the one place where the calls must stay apart.
This function, registered with transformers' AttentionInterface under NAME, writes each call's
new keys and values into that call's own cache (`CallKV`) and attends over it per call, so a
call's numbers never mix with its batch-mates'.

Shared prefixes. The calls of an agent workload open alike: every rollout of a GRPO group starts
from the same system prompt and task, and a harness's sessions share their system prompt. On a
CPU a decode step's attention is bound by reading keys and values (fp32, 46 KB per token of
SmolLM2 across its layers), so eight calls that each read their own copy of a 1.5k-token prefix
cost eight times what one read costs. A call's cache is therefore two parts: `base`, a read-only
view of positions another call already computed (shared, never copied), and `data`, its own
positions after that. Calls whose base is the same view form a group, and each layer attends in
two parts, merged exactly by their log-sum-exp (as cascade attention does): the group's queries,
all stacked, against the base in one kernel call (the base is read once per step), and each call's
queries against its own positions. A call with no base attends in one part, as plain SDPA.

The caches are ours, not transformers' `DynamicCache`: a call joins and leaves the batch at any
step, and a cache per call that grows in place (capacity doubles) needs no re-stacking when the
batch changes. The step's plan (`StepPlan`) reaches the function as the `step_plan` keyword,
which transformers passes through untouched; the engine advances each cache once the whole
forward is done (`StepPlan.commit`), because every layer writes at the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "polar_fast_batched_decode"
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp)


class CallKV:
    """One call's keys and values for every layer: positions [0, base_len) in `base` (a shared,
    read-only (layers, 2, kv_heads, base_len, head_dim) view, or None), positions
    [base_len, length) in its own `data` (layers, 2, kv_heads, capacity, head_dim)."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256) -> None:
        self.base: torch.Tensor | None = None
        self.data = torch.empty(n_layers, 2, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.own = 0  # filled positions of `data`

    @classmethod
    def for_model(cls, config: Any, *, dtype: torch.dtype, device: torch.device | str,
                  capacity: int = 256) -> CallKV:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype=dtype, device=device,
                   capacity=capacity)

    @property
    def base_len(self) -> int:
        return 0 if self.base is None else self.base.shape[3]

    @property
    def length(self) -> int:
        return self.base_len + self.own

    def reserve(self, n: int) -> None:
        """Room for `n` positions in all (doubling, so appends cost O(1) amortised)."""
        need = n - self.base_len
        if need <= self.data.shape[3]:
            return
        grown = self.data.new_empty(*self.data.shape[:3], max(need, 2 * self.data.shape[3]), self.data.shape[4])
        grown[:, :, :, : self.own] = self.data[:, :, :, : self.own]
        self.data = grown

    def share_prefix(self, n: int) -> CallKV:
        """A cache for another call that holds the first `n` positions of this one. They are
        shared, not copied, where they can be: when this cache has no base yet, its first `n`
        positions become its base (a view; nothing moves), so that both calls read one copy."""
        if not 0 < n <= self.length:
            raise ValueError(f"share_prefix({n}) of a cache holding {self.length} positions")
        if self.base is None and n <= self.own:
            self.base = self.data[:, :, :, :n]
            self.data, self.own = self.data[:, :, :, n:], self.own - n
        mine = CallKV.__new__(CallKV)
        if n <= self.base_len:
            mine.base = self.base if n == self.base_len else self.base[:, :, :, :n]
            mine.data, mine.own = self.data.new_empty(*self.data.shape[:3], 256, self.data.shape[4]), 0
        else:  # the shared base plus a copy of the own positions it needs
            mine.base, mine.own = self.base, n - self.base_len
            mine.data = self.data.new_empty(*self.data.shape[:3], mine.own + 256, self.data.shape[4])
            mine.data[:, :, :, : mine.own] = self.data[:, :, :, : mine.own]
        return mine

    copy_prefix = share_prefix  # the name prefix_cache.PrefixCache.take calls

    def base_key(self) -> tuple[int, int] | None:
        """Equal for calls whose base is the same positions of the same storage."""
        if self.base is None:
            return None
        return (self.base.data_ptr(), self.base_len)


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
class _Views:
    """One segment's cache views for this step, made once and indexed by layer in every layer."""

    k_new: torch.Tensor  # (layers, H_kv, L, D): where its new keys go
    v_new: torch.Tensor
    keys: torch.Tensor  # (layers, 1, H_kv, own + L, D): its own positions, the new ones included
    values: torch.Tensor
    mask: torch.Tensor | None  # over its own positions, rows in _fold's order when it has a base


@dataclass(frozen=True, eq=False)
class StepPlan:
    segments: list[Segment]
    views: list[_Views]
    groups: list[tuple[list[int], torch.Tensor]]  # (segment indices, their base (layers, 2, H_kv, P, D))

    @property
    def sizes(self) -> list[int]:
        return [s.n for s in self.segments]

    @classmethod
    def of(cls, segments: list[Segment], device: torch.device | str, dtype: torch.dtype = torch.float32,
           rep: int = 1) -> StepPlan:
        """`rep`: query heads per key head (the model's GQA ratio)."""
        by_base: dict[tuple[int, int], tuple[list[int], torch.Tensor]] = {}
        views = []
        for i, s in enumerate(segments):
            s.kv.reserve(s.kv.length + s.n)
            past, total, data = s.kv.own, s.kv.own + s.n, s.kv.data
            mask = _own_mask(s, device, dtype)
            if mask is not None and s.kv.base is not None:
                mask = mask.repeat(rep, 1)
            views.append(_Views(data[:, 0, :, past:total], data[:, 1, :, past:total],
                                data[:, 0, None, :, :total], data[:, 1, None, :, :total], mask))
            if (key := s.kv.base_key()) is not None:
                by_base.setdefault(key, ([], s.kv.base))[0].append(i)
        return cls(segments, views, list(by_base.values()))

    def commit(self) -> None:
        """After the forward: every layer has written the segments' keys and values."""
        for s in self.segments:
            s.kv.own += s.n


def _own_mask(s: Segment, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor | None:
    """(L, own + L) additive (0 or -inf; the flash kernel takes no booleans) over the call's own
    positions, or None where none is needed: one query sees all it has, and a whole causal chunk
    with nothing before it and no base is SDPA's is_causal (which aligns to the top-left corner,
    so only there). Base positions come before every query: they need no mask at all."""
    past = s.kv.own
    if s.n == 1 or (past == 0 and s.kv.base is None):
        return None
    q = torch.arange(s.n, device=device)[:, None]
    k = torch.arange(past + s.n, device=device)[None, :]
    return torch.zeros(q.shape[0], k.shape[1], dtype=dtype, device=device).masked_fill_(k > past + q, float("-inf"))


def _fold(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(1, H, L, D) -> (1, H_kv, rep * L, D): the query heads that share a key head become rows of
    that head, so the flash kernel reads each key and value once per key head."""
    _, h, n, d = q.shape
    return q.reshape(1, kv_heads, (h // kv_heads) * n, d)


def _unfold(out: torch.Tensor, heads: int) -> torch.Tensor:
    _, kv_heads, rows, d = out.shape
    return out.reshape(1, heads, rows * kv_heads // heads, d)


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
    """transformers' face of `attend` (the engine's step through the model's own forward)."""
    if step_plan is None:
        raise ValueError(f"{NAME} needs a step_plan (the embedded engine passes one)")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError(f"{NAME} does not support softcap or sliding-window attention")
    return attend(module.layer_idx, query, key, value, step_plan, scaling), None


def attend(
    layer: int,
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, H_kv, T, D)
    value: torch.Tensor,  # (1, H_kv, T, D)
    plan: StepPlan,
    scaling: float | None,
) -> torch.Tensor:  # (1, T, H, D)
    """One layer's attention for the step: writes the segments' new keys and values into their
    calls' caches, then attends per call (the base of a group once for all its members)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    sizes = plan.sizes
    queries, keys, values = query.split(sizes, 2), key[0].split(sizes, 1), value[0].split(sizes, 1)
    outs: list[torch.Tensor | None] = [None] * len(sizes)
    own: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sizes)  # (out, lse), folded
    # one dispatch for every call's cache write, not two per call
    torch._foreach_copy_([v.k_new[layer] for v in plan.views] + [v.v_new[layer] for v in plan.views],
                         list(keys) + list(values))
    for i, (s, v) in enumerate(zip(plan.segments, plan.views)):
        if s.kv.base is None:  # one part: plain SDPA over its own positions
            outs[i] = F.scaled_dot_product_attention(
                queries[i], v.keys[layer], v.values[layer], attn_mask=v.mask, is_causal=v.mask is None and s.n > 1,
                scale=scaling, enable_gqa=heads != kv_heads)
        else:
            own[i] = _flash(_fold(queries[i], kv_heads), v.keys[layer], v.values[layer], attn_mask=v.mask,
                            scale=scaling)
    for members, base in plan.groups:
        folded = [_fold(queries[i], kv_heads) for i in members]
        stacked = torch.cat(folded, 2) if len(folded) > 1 else folded[0]
        base_out, base_lse = _flash(stacked, base[layer, 0, None], base[layer, 1, None], scale=scaling)
        own_out = torch.cat([own[i][0] for i in members], 2) if len(members) > 1 else own[members[0]][0]
        own_lse = torch.cat([own[i][1] for i in members], 2) if len(members) > 1 else own[members[0]][1]
        merged = _merge(base_out, base_lse, own_out, own_lse)  # rows in the same order: one merge per group
        for i, part in zip(members, merged.split([f.shape[2] for f in folded], 2)):
            outs[i] = _unfold(part, heads)
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous()


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each set's normalised
    output and log-sum-exp: the weights are each part's share of the total mass."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top).unsqueeze(-1), torch.exp(lse_b - top).unsqueeze(-1)
    # in float32 whatever the cache's dtype (the log-sum-exps are float32): a bf16 step rounds once
    merged = (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)
    return merged.to(out_a.dtype)


AttentionInterface.register(NAME, batched_decode_attention)
