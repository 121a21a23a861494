"""Packed recurrence: linear-attention layers (Gated DeltaNet) on `paths` and `tree` micro-batches.

A recurrent layer mixes tokens in two places only: a causal depthwise conv1d over the last K
inputs and the gated delta rule scan, whose state runs from the first token to the last. Packed
as one row, both leak across sequences (`paths`) and across sibling branches (`tree`). Here
the packed tokens are cut into segments, maximal chains in which each token is the previous
one's only child (packed_attention's runs: a `paths` sequence, a per-call sequence, the trunk
of a tree, a branch between two branch points), and:

- the conv runs over the whole packed row at once, then the first K-1 tokens of each segment are
  recomputed from their real ancestors (the tail of the parent segment, or zeros at a root):
  the conv's last inputs are handed over exactly, at (K-1) rows per segment;
- the scan runs segment by segment, each segment starting from the final state of its parent
  segment (zeros at a root). Segments at the same depth in the segment tree do not depend on
  each other, so they run as one batched call of the model's own kernel (the torch reference,
  or flash-linear-attention's when installed), padded with no-op tokens (beta = 0, g = 0: the
  state neither decays nor updates, so a padded row's final state is its last real token's).
  Rows of very different lengths go into separate calls, so padding stays small.

Gradients flow through the handed-over states and conv inputs: nothing is detached. A shared
prefix is still computed once for all its branches. Cost: one kernel call per segment level
and length bucket, so the number of sequential calls grows with the number of branch points
along the deepest root-to-leaf path (not with the number of branches), and the tokens computed
stay the tree's tokens plus padding.

Hook. transformers has a registry for attention functions (packed_attention uses it) but none
for these kernels; a Gated DeltaNet layer calls the module-level functions `causal_conv1d_fn`
and `torch_chunk_gated_delta_rule` of its modeling module and passes them the keyword
arguments it was given. `install(model)` wraps those two functions in each such modeling
module: with a `packed_segments` keyword (PackedLM passes one) they run the packed versions
here, without one they call the original unchanged, so generation and per-call forwards are
untouched.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

KEYWORD = "packed_segments"
CHUNK_TOKENS = 64  # the scan kernels' chunk: a segment costs whole chunks
PAD_SLACK = 1.5  # a batched call may compute at most this many chunks per real one
HOOKED = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")


@dataclass(frozen=True, eq=False)
class Call:
    """One batched scan call: `index` (R, L) packed rows, T where padded."""

    index: torch.Tensor  # (R, L) long
    valid: torch.Tensor  # (R, L) bool
    parent_row: torch.Tensor | None  # (R,) long: rows of the previous level's final states; None at level 0


@dataclass(frozen=True, eq=False)
class Segments:
    """The segment plan of one packed micro-batch, built once and shared by every layer."""

    n_tokens: int
    parent: np.ndarray  # (T,) int64 parent row, -1 at a root
    offset: np.ndarray  # (T,) int64 position inside its segment
    levels: list[list[Call]]  # calls per segment level, in order
    order: torch.Tensor  # (T,) long: packed row of each scan output row, in call order
    inverse: torch.Tensor  # (T,) long: scan output row of each packed row
    device: torch.device
    _conv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def n_segments(self) -> int:
        return int((self.offset == 0).sum())

    @property
    def n_calls(self) -> int:
        return sum(len(level) for level in self.levels)

    def conv_rows(self, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows whose conv window crosses a segment start, and (rows, K) their window's rows
        (the ancestors at distance K-1 .. 0, T past a root)."""
        if kernel not in self._conv:
            rows = np.flatnonzero(self.offset < kernel - 1)
            window = np.empty((len(rows), kernel), np.int64)
            at = rows.copy()
            for j in range(kernel - 1, -1, -1):
                window[:, j] = np.where(at >= 0, at, self.n_tokens)
                at = np.where(at >= 0, self.parent[np.maximum(at, 0)], -1)
            self._conv[kernel] = (torch.from_numpy(rows).to(self.device),
                                  torch.from_numpy(window).to(self.device))
        return self._conv[kernel]


def plan(size: torch.Tensor) -> Segments:
    """Segments of a packed micro-batch from its subtree sizes (merge arrays, DFS order)."""
    s = size.cpu().numpy().astype(np.int64)
    t = len(s)
    starts = np.flatnonzero(np.r_[True, s[:-1] != s[1:] + 1]) if t else np.zeros(0, np.int64)
    stops = np.r_[starts[1:], t].astype(np.int64)
    parent_seg = np.full(len(starts), -1, np.int64)
    level = np.zeros(len(starts), np.int64)
    stack: list[int] = []  # open segments: their last token's subtree still holds what follows
    for r, a in enumerate(starts.tolist()):
        while stack and stops[stack[-1]] - 1 + s[stops[stack[-1]] - 1] <= a:
            stack.pop()
        if stack:
            parent_seg[r], level[r] = stack[-1], level[stack[-1]] + 1
        stack.append(r)
    seg_of = np.repeat(np.arange(len(starts)), stops - starts)
    offset = np.arange(t) - starts[seg_of] if t else np.zeros(0, np.int64)
    parent = np.arange(t, dtype=np.int64) - 1
    parent[starts] = np.where(parent_seg >= 0, stops[np.maximum(parent_seg, 0)] - 1, -1)
    device = size.device
    levels, order, row_in_level = [], [], np.zeros(len(starts), np.int64)
    for lv in range(int(level.max()) + 1 if len(starts) else 0):
        segs = np.flatnonzero(level == lv)
        segs = segs[np.argsort(-(stops[segs] - starts[segs]), kind="stable")]
        row_in_level[segs] = np.arange(len(segs))
        calls = []
        for bucket in _buckets((stops - starts)[segs]):
            chosen = segs[bucket]
            n = stops[chosen] - starts[chosen]
            steps = np.arange(n.max())
            index = starts[chosen, None] + steps[None, :]
            valid = steps[None, :] < n[:, None]
            order.append(index[valid])
            parents = None
            if lv:
                parents = torch.from_numpy(row_in_level[parent_seg[chosen]]).to(device)
            calls.append(Call(torch.from_numpy(np.where(valid, index, t)).to(device),
                              torch.from_numpy(valid).to(device), parents))
        levels.append(calls)
    flat = np.concatenate(order) if order else np.zeros(0, np.int64)
    inverse = np.empty(t, np.int64)
    inverse[flat] = np.arange(t)
    return Segments(t, parent, offset, levels, torch.from_numpy(flat).to(device),
                    torch.from_numpy(inverse).to(device), device)


def _buckets(lengths: np.ndarray) -> list[np.ndarray]:
    """Consecutive groups of `lengths` (sorted, longest first) that pad to at most PAD_SLACK x."""
    chunks = -(-lengths // CHUNK_TOKENS)
    out, first, real = [], 0, 0
    for i, c in enumerate(chunks.tolist()):
        if i > first and (i - first + 1) * chunks[first] > PAD_SLACK * (real + c):
            out.append(np.arange(first, i))
            first, real = i, 0
        real += c
    if len(lengths):
        out.append(np.arange(first, len(lengths)))
    return out


def packed_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  activation: str | None, segments: Segments) -> torch.Tensor:
    """causal_conv1d_fn over a packed (1, C, T) row: each token sees only its own ancestors."""
    _, channels, t = hidden_states.shape
    kernel = weight.shape[-1]
    x = hidden_states.to(weight.dtype)
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=kernel - 1, groups=channels)[:, :, :t]
    rows, window = segments.conv_rows(kernel)
    if len(rows):
        inputs = F.pad(x, (0, 1))[:, :, window]  # (1, C, rows, K); column T is the zero past a root
        fixed = (inputs * weight[None, :, None, :]).sum(-1)
        if bias is not None:
            fixed = fixed + bias[None, :, None]
        out = out.index_copy(2, rows, fixed.to(out.dtype))  # CUDA autocast runs the conv in bf16
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def packed_scan(kernel: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, segments: Segments, **options: Any) -> torch.Tensor:
    """The gated delta rule over a packed row (1, T, H, D), segment level by level; (1, T, Hv, Dv)."""
    def rows(x: torch.Tensor) -> torch.Tensor:  # (T + 1, ...): a zero row at T for padding
        return torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])

    q, k, v, gg, bb = (rows(x) for x in (query, key, value, g, beta))
    outs, finals = [], None
    for level in segments.levels:
        level_finals = []
        for call in level:
            init = None if call.parent_row is None else finals.index_select(0, call.parent_row)
            out, final = kernel(q[call.index], k[call.index], v[call.index], g=gg[call.index],
                                beta=bb[call.index], initial_state=init, output_final_state=True, **options)
            outs.append(out[call.valid])  # (real rows, Hv, Dv), in call order
            level_finals.append(final)
        finals = torch.cat(level_finals) if len(level_finals) > 1 else level_finals[0]
    flat = torch.cat(outs) if len(outs) > 1 else outs[0]
    return flat.index_select(0, segments.inverse)[None]


def _conv_hook(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        segments = kwargs.pop(KEYWORD, None)
        if segments is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return packed_conv1d(hidden_states, weight, bias, activation, segments)

    causal_conv1d_fn.polar_original = original
    return causal_conv1d_fn


def _scan_hook(original: Callable) -> Callable:
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        segments = kwargs.pop(KEYWORD, None)
        if segments is None:
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            cu_seqlens=cu_seqlens, **kwargs)
        if initial_state is not None or cu_seqlens is not None:
            raise ValueError(f"{KEYWORD} replaces initial_state and cu_seqlens; got them as well")
        out = packed_scan(original, query, key, value, g, beta, segments,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return out, None

    torch_chunk_gated_delta_rule.polar_original = original
    return torch_chunk_gated_delta_rule


def recurrent_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer whose modeling module has the hooked kernels (Gated DeltaNet)."""
    out = []
    for name, module in model.named_modules():
        source = sys.modules.get(type(module).__module__)
        if type(module).__name__.endswith("GatedDeltaNet") and all(hasattr(source, f) for f in HOOKED):
            out.append((name, module))
    return out


def install(model: nn.Module) -> bool:
    """Hook the kernels of every recurrent layer's modeling module (idempotent); True if any."""
    layers = recurrent_layers(model)
    for _, module in layers:
        source = sys.modules[type(module).__module__]
        for name, hook in zip(HOOKED, (_conv_hook, _scan_hook)):
            if not hasattr(getattr(source, name), "polar_original"):
                setattr(source, name, hook(getattr(source, name)))
    return bool(layers)
