"""The learner's start-up guard: the packed forward of this architecture equals one forward per call.

Packing is exact only if every layer keeps packed sequences apart and, in a tree, sees exactly
its ancestors: attention through the mask or plan, recurrent layers (learner/packed_recurrence)
through their segment hand-over. A layer type that does neither (the next recurrent or
state-space model) would train silently on logprobs that do not belong to the tokens. So at
start the learner builds a tiny random model of the configured architecture (the same class and
layer types, small widths and vocabulary, a few layers) and runs a branchy group of synthetic
calls through the packed forward of the configured layout and through one plain forward per
call, comparing each decoder layer's output, the sampled tokens' logprobs and the gradients.
A mismatch raises PackedForwardError naming the layout and the first layer that differs.
The check costs well under a second of CPU on tiny models and runs once per architecture,
layout and attention kernel in a process.
"""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import torch
from torch import nn

from polar_fast import merge
from polar_fast.errors import PackedForwardError
from polar_fast.learner.packed_forward import PackedLM, batch_tensors, loss_terms
from polar_fast.records import CallRecord

TOLERANCE = 1e-4  # fp32; exact layouts differ by ~1e-6, a leak by 1e-3 and more
VOCAB = 256
# widths shrunk to at most these (head dims are kept: rotary and kernel layouts depend on them)
SHRINK = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4, "num_local_experts": 4,
          "num_experts_per_tok": 2, "vocab_size": VOCAB}

_passed: set[tuple] = set()


def tiny_copy(model: nn.Module) -> nn.Module:
    """A randomly initialised float32 model of `model`'s class with its layer types, tiny widths."""
    cfg = copy.deepcopy(model.config)
    for key, most in SHRINK.items():
        if isinstance(getattr(cfg, key, None), int):
            setattr(cfg, key, min(getattr(cfg, key), most))
    if getattr(cfg, "num_attention_heads", 1) % getattr(cfg, "num_key_value_heads", 1):
        cfg.num_key_value_heads = 1
    if getattr(cfg, "linear_num_value_heads", 1) % getattr(cfg, "linear_num_key_heads", 1):
        cfg.linear_num_key_heads = 1
    types = list(getattr(cfg, "layer_types", None) or [])
    n_layers = 2
    if types:  # the shortest prefix holding every layer type
        n_layers = max(2, max(types.index(t) for t in set(types)) + 1)
        cfg.layer_types = types[:n_layers]
    cfg.num_hidden_layers = n_layers
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, key, None), int) and getattr(cfg, key) >= cfg.vocab_size:
            setattr(cfg, key, None)
    torch.manual_seed(0)
    return type(model)(cfg).float().eval()


def branchy_calls(vocab: int, seed: int = 0) -> list[CallRecord]:
    """Two rollouts sharing a prompt, a clean extension, a compaction and a fresh sub-agent call;
    long enough that segments cross the recurrent kernels' 64-token chunks."""
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    def call(rid: str, i: int, prompt: list[int], completion: list[int]) -> CallRecord:
        return CallRecord(session_id=rid, rollout_id=rid, group_id="check", call_index=i, prompt_ids=prompt,
                          completion_ids=completion, completion_logprobs=[-1.0] * len(completion),
                          policy_version=0, finish_reason="stop", dialect="chat")

    system = ids(70)
    a0 = call("a", 0, system, ids(8))
    a1 = call("a", 1, system + a0.completion_ids + ids(6), ids(7))
    a2 = call("a", 2, system[:20] + ids(9), ids(5))
    b0 = call("b", 0, system, a0.completion_ids[:3] + ids(4))
    sub = call("b", 1, ids(12), ids(6))
    return [a0, a1, a2, b0, sub]


def check(model: nn.Module, layout: str, *, attention: str, device: torch.device | str = "cpu",
          merge_impl: merge.Impl = "rust") -> None:
    """Raise PackedForwardError unless `layout` trains `model`'s architecture exactly."""
    key = (type(model), tuple(getattr(model.config, "layer_types", None) or ()), layout, attention,
           torch.device(device).type)
    if key in _passed:
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more CPU threads only spin-wait (20x slower on a busy box)
    try:
        _compare(model, layout, attention, device, merge_impl)
    finally:
        torch.set_num_threads(threads)
    _passed.add(key)


def _compare(model: nn.Module, layout: str, attention: str, device: torch.device | str,
             merge_impl: merge.Impl) -> None:
    tiny = tiny_copy(model).to(device)
    tiny.set_attn_implementation("sdpa")  # the reference: plain per-call forwards
    calls = branchy_calls(tiny.config.vocab_size)
    ref_layers, ref_logp, ref_grad = _per_call(tiny, calls)
    tiny.set_attn_implementation(attention)
    layers, logp, grad = _packed(tiny, calls, layout, merge_impl)
    layer_gap = [max((row - ref_layers[i][path]).abs().max().item() for path, row in layers[i])
                 for i in range(len(ref_layers))]
    logp_gap = max(abs(logp[k] - ref_logp[k]) for k in ref_logp)
    grad_gap = ((grad - ref_grad).abs().max() / ref_grad.abs().max().clamp_min(1e-12)).item()
    if max(layer_gap + [logp_gap, grad_gap]) > TOLERANCE:
        raise PackedForwardError(_message(tiny, layout, attention, layer_gap, logp_gap, grad_gap))


def _message(tiny: nn.Module, layout: str, attention: str, layer_gap: list[float], logp_gap: float,
             grad_gap: float) -> str:
    bad = [i for i, gap in enumerate(layer_gap) if gap > TOLERANCE]
    types = getattr(tiny.config, "layer_types", None)
    where = "no layer output differs, only the gradients"
    if bad:
        i = bad[0]
        layer = tiny.get_decoder().layers[i]
        mixer = next((type(m).__name__ for name, m in layer.named_children() if "attn" in name or "mixer" in name),
                     type(layer).__name__)
        kind = f"{types[i]}, " if types else ""
        where = (f"first at decoder layer {i} ({kind}{mixer}), max |output difference| {layer_gap[i]:.1e}; "
                 f"layers that differ: {bad}")
    return (f"the packed '{layout}' forward of {type(tiny).__name__} (attention {attention!r}) differs from one "
            f"forward per call on a tiny random model of the same class and layer types: {where}; "
            f"max |logprob difference| {logp_gap:.1e}, relative gradient difference {grad_gap:.1e} "
            f"(tolerance {TOLERANCE:g}). Training it would use logprobs that do not belong to the sampled tokens. "
            f"Train with the other merge.layout if it passes, or add packed support for this layer type "
            f"(learner/packed_recurrence.py); learner.check_packed = false skips this check.")


def _capture(model: nn.Module) -> tuple[list[torch.Tensor], Callable[[], None]]:
    outputs: list[torch.Tensor] = []

    def hook(_module, _args, out):
        outputs.append((out[0] if isinstance(out, tuple) else out)[0].detach())  # (T, H)

    handles = [layer.register_forward_hook(hook) for layer in model.get_decoder().layers]
    return outputs, lambda: [h.remove() for h in handles]


def _per_call(model: nn.Module, calls: list[CallRecord]) -> tuple[list[dict], dict, torch.Tensor]:
    """Per layer {token path: output row}, {(token path, rollout): logprob}, flat gradient."""
    device = next(model.parameters()).device
    model.zero_grad()
    layers: list[dict] = [{} for _ in model.get_decoder().layers]
    logp, total = {}, 0.0
    for c in calls:
        seq = c.prompt_ids + c.completion_ids
        outputs, remove = _capture(model)
        logits = model(torch.tensor([seq], device=device)).logits[0].float().log_softmax(-1)
        remove()
        for i, out in enumerate(outputs):
            for j in range(len(seq)):
                layers[i][tuple(seq[: j + 1])] = out[j]
        n_p = len(c.prompt_ids)
        for j, token in enumerate(c.completion_ids):
            value = logits[n_p + j - 1, token]
            logp[(tuple(seq[: n_p + j + 1]), c.rollout_id)] = value.item()
            total = total + value
    total.backward()
    return layers, logp, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _packed(model: nn.Module, calls: list[CallRecord], layout: str, merge_impl: merge.Impl
            ) -> tuple[list[list], dict, torch.Tensor]:
    """Per layer [(token path, output row)] (a `paths` node repeats), logprobs, flat gradient."""
    device = next(model.parameters()).device
    model.zero_grad()
    wrapper = PackedLM(model)
    merged = merge.merge(calls, layout=layout, impl=merge_impl)
    layers: list[list] = [[] for _ in model.get_decoder().layers]
    logp, total = {}, 0.0
    for mb in merge.pack(merged, max_tokens=4096, impl=merge_impl):
        terms = loss_terms(mb)
        paths: list[tuple] = []
        for q in range(len(mb.tokens)):  # DFS order: a parent comes before its children
            p = int(mb.parent[q])
            paths.append((paths[p] if p >= 0 else ()) + (int(mb.tokens[q]),))
        outputs, remove = _capture(model)
        values = wrapper(**batch_tensors(mb, terms, device))
        remove()
        for i, out in enumerate(outputs):
            layers[i].extend(zip(paths, out))
        for pos, r, value in zip(terms.position, terms.rollout, values.tolist()):
            logp[(paths[pos], merged.rollout_ids[r])] = value
        total = total + values.sum()
    total.backward()
    return layers, logp, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
