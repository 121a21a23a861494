"""Attention for the embedded engine's batched steps: every call sees only its own keys, and a
prefix that several calls share is read once for all of them.

One engine step forwards one packed row of tokens taken from several calls: a decode token of
each running call and a chunk of a joining call's prompt. Every linear layer then reads its
weights once for the whole batch. Attention is the one place where the calls must stay apart.
`attend` writes each call's new keys and values into that call's own cache (`CallKV`) and
attends over it per call, so a call's numbers never mix with its batch-mates'. The fused step
(decode_step.py) calls it directly; transformers' forward reaches it through the function
registered with its AttentionInterface under NAME.

Shared prefixes. The calls of an agent workload open alike: every rollout of a GRPO group starts
from the same system prompt and task, and a harness's sessions share their system prompt. On a
CPU a decode step's attention is bound by reading keys and values (fp32, 46 KB per token of
SmolLM2 across its layers), so eight calls that each read their own copy of a 1.5k-token prefix
cost eight times what one read costs. A call's cache is therefore two parts: `base`, a read-only
view of positions another call already computed (shared, never copied), and `data`, its own
positions after that. Calls whose base is the same view form a group, and each layer attends in
two parts, merged exactly by their log-sum-exp (as cascade attention does): the group's queries,
all stacked, against the base in one kernel call (the base is read once per step), and each call's
queries against its own positions. A call with no base attends in one part.

The caches are ours, not transformers' `DynamicCache`: a call joins and leaves the batch at any
step, and a cache per call that grows in place (capacity doubles) needs no re-stacking when the
batch changes. The step's plan (`StepPlan`) reaches the function as the `step_plan` keyword,
which transformers passes through untouched; the engine advances each cache once the whole
forward is done (`StepPlan.commit`), because every layer writes at the same positions. The plan
also holds every view a layer needs, made once per step rather than once per layer and call: a
decode step's attention kernels are tens of microseconds each, the size of the Python around them.
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
class _Group:
    """Segments that share one base: their query rows are attended against it in one call."""

    members: list[int]  # segment indices, in packing order
    rows: slice | torch.Tensor  # their rows of the folded queries: a slice when adjacent
    keys: tuple[torch.Tensor, ...]  # per layer (1, H_kv, P, D): the base
    values: tuple[torch.Tensor, ...]


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything a layer's attention needs that does not change from layer to layer, made once
    per step, so that a layer does no per-call indexing in Python: per layer, the views its new
    keys and values are copied into (one dispatch for all calls) and each call's own keys and
    values; per segment its rows of the folded queries and its mask; the groups."""

    segments: list[Segment]
    rep: int  # query heads per key head
    writes: list[list[torch.Tensor]]  # per layer: every segment's new-key views, then new-value views
    keys: list[list[torch.Tensor]]  # per layer, per segment (1, H_kv, own + L, D): its own positions
    values: list[list[torch.Tensor]]
    rows: list[slice]  # per segment: its rows of the folded queries
    masks: list[torch.Tensor | None]  # per segment (rep * L, own + L), rows in folded order
    groups: list[_Group]

    @property
    def sizes(self) -> list[int]:
        return [s.n for s in self.segments]

    @classmethod
    def of(cls, segments: list[Segment], device: torch.device | str, dtype: torch.dtype = torch.float32,
           rep: int = 1) -> StepPlan:
        """`rep`: query heads per key head (the model's GQA ratio)."""
        new_k, new_v, keys, values, rows, masks = [], [], [], [], [], []
        by_base: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(segments):
            s.kv.reserve(s.kv.length + s.n)
            past, total, data = s.kv.own, s.kv.own + s.n, s.kv.data
            new_k.append(data[:, 0, :, past:total].unbind(0))  # per layer (H_kv, L, D)
            new_v.append(data[:, 1, :, past:total].unbind(0))
            keys.append(data[:, 0, None, :, :total].unbind(0))  # per layer (1, H_kv, own + L, D)
            values.append(data[:, 1, None, :, :total].unbind(0))
            rows.append(slice(rep * s.start, rep * s.stop))
            masks.append(_own_mask(s, device, dtype, rep))
            if (key := s.kv.base_key()) is not None:
                by_base.setdefault(key, []).append(i)
        layers = segments[0].kv.data.shape[0] if segments else 0
        groups = [_Group(members, _rows_of(members, segments, rep, device),
                         segments[members[0]].kv.base[:, 0, None].unbind(0),
                         segments[members[0]].kv.base[:, 1, None].unbind(0)) for members in by_base.values()]
        return cls(segments, rep,
                   [[k[layer] for k in new_k] + [v[layer] for v in new_v] for layer in range(layers)],
                   [[k[layer] for k in keys] for layer in range(layers)],
                   [[v[layer] for v in values] for layer in range(layers)], rows, masks, groups)

    def commit(self) -> None:
        """After the forward: every layer has written the segments' keys and values."""
        for s in self.segments:
            s.kv.own += s.n


def _rows_of(members: list[int], segments: list[Segment], rep: int, device) -> slice | torch.Tensor:
    """The folded query rows of these segments, in their order: a slice when they are adjacent."""
    if all(b == a + 1 for a, b in zip(members, members[1:])):
        return slice(rep * segments[members[0]].start, rep * segments[members[-1]].stop)
    return torch.cat([torch.arange(rep * segments[i].start, rep * segments[i].stop, device=device) for i in members])


def _own_mask(s: Segment, device: torch.device | str, dtype: torch.dtype, rep: int) -> torch.Tensor | None:
    """(rep * L, own + L) additive (0 or -inf; the flash kernel takes no booleans) over the call's
    own positions, rows in folded order (a query's `rep` heads in a row), or None where one
    query sees all it has. Base positions come before every query: they need no mask at all."""
    if s.n == 1:
        return None
    past = s.kv.own
    q = torch.arange(s.n, device=device)[:, None]
    k = torch.arange(past + s.n, device=device)[None, :]
    mask = torch.zeros(s.n, past + s.n, dtype=dtype, device=device).masked_fill_(k > past + q, float("-inf"))
    return mask.repeat_interleave(rep, 0)


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
    out = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                 step_plan, scaling)
    return out.view(1, out.shape[0], query.shape[1], -1), None


def attend(
    layer: int,
    query: torch.Tensor,  # (T, H, D)
    key: torch.Tensor,  # (T, H_kv, D)
    value: torch.Tensor,  # (T, H_kv, D)
    plan: StepPlan,
    scaling: float | None,
) -> torch.Tensor:  # (T, H * D)
    """One layer's attention for the step: writes the segments' new keys and values into their
    calls' caches, then attends per call, the base of a group once for all its members.

    Queries are folded once for the whole step: the `rep` query heads that share a key head
    become rows of that head, (1, H_kv, T * rep, D) with a token's heads in adjacent rows. Every
    call's rows are then a slice, and the flash kernel reads each key and value once per key
    head. A row's result does not depend on the other rows in the call."""
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.view(tokens, kv_heads, plan.rep, dim).transpose(0, 1).reshape(1, kv_heads, tokens * plan.rep, dim)
    sizes = plan.sizes
    torch._foreach_copy_(plan.writes[layer], [*key.transpose(0, 1).split(sizes, 1), *value.transpose(0, 1).split(sizes, 1)])
    keys, values = plan.keys[layer], plan.values[layer]
    parts = [_flash(folded[:, :, rows], k, v, attn_mask=mask, scale=scaling)  # (out, lse) over own positions
             for rows, k, v, mask in zip(plan.rows, keys, values, plan.masks)]
    outs = [out for out, _ in parts]
    for g in plan.groups:
        stacked = folded[:, :, g.rows] if isinstance(g.rows, slice) else folded.index_select(2, g.rows)
        base_out, base_lse = _flash(stacked, g.keys[layer], g.values[layer], scale=scaling)
        own_out = torch.cat([parts[i][0] for i in g.members], 2) if len(g.members) > 1 else parts[g.members[0]][0]
        own_lse = torch.cat([parts[i][1] for i in g.members], 2) if len(g.members) > 1 else parts[g.members[0]][1]
        merged = _merge(base_out, base_lse, own_out, own_lse)  # rows in the same order: one merge per group
        if len(g.members) == len(outs):  # every call shares this base (the usual step): nothing to reassemble
            outs = [merged]
            break
        for i, part in zip(g.members, merged.split([outs[i].shape[2] for i in g.members], 2)):
            outs[i] = part
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]  # (1, H_kv, T * rep, D)
    return out[0].reshape(kv_heads, tokens, plan.rep, dim).transpose(0, 1).reshape(tokens, heads * dim)


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each set's normalised
    output and log-sum-exp: part a's weight is its share of the total mass,
    e^lse_a / (e^lse_a + e^lse_b) = sigmoid(lse_a - lse_b). In float32 whatever the cache's dtype
    (the log-sum-exps are float32), so a bf16 step rounds once."""
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return torch.lerp(out_b.float(), out_a.float(), share_a).to(out_a.dtype)


AttentionInterface.register(NAME, batched_decode_attention)
