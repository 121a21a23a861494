"""Packed forwards (`tree`, `paths`) give the same per-token logprobs and gradients as one
separate forward per call, on traces with branches: two rollouts sharing a prompt (with an
extra sample), a compaction that rewrites history, and a sub-agent call with a fresh prompt.
Models: a tiny Llama (attention only) and a tiny hybrid Qwen3.5 (three Gated DeltaNet layers,
whose conv and scan state must restart per sequence and be handed down a tree, then one full
attention layer), both the real transformers classes with random weights."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from polar_fast.learner import packed_attention
from polar_fast.learner.packed_forward import PackedLM, batch_tensors, dense_mask, loss_terms
from polar_fast.merge import reference as merge_reference
from polar_fast.records import CallRecord


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: more CPU threads only spin-wait (on a busy 2-core box, 20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def merge_impls() -> list:
    impls = [merge_reference]
    try:
        impls.append(importlib.import_module("polar_fast.merge"))
    except ImportError:  # the Rust extension is not built in this checkout
        pass
    return impls


def branchy_calls(rng: np.random.Generator, vocab: int, prompt_len: int = 24) -> list[CallRecord]:
    def ids(n: int) -> list[int]:
        return rng.integers(3, vocab, n).tolist()

    def call(rid: str, i: int, prompt: list[int], completion: list[int]) -> CallRecord:
        return CallRecord(session_id=rid, rollout_id=rid, group_id="g", call_index=i, prompt_ids=prompt,
                          completion_ids=completion, completion_logprobs=(-rng.random(len(completion))).tolist(),
                          policy_version=0, finish_reason="stop", dialect="chat")

    system = ids(prompt_len)
    a0 = call("a", 0, system, ids(6))
    a1 = call("a", 1, system + a0.completion_ids + ids(4), ids(5))  # clean extension
    a2 = call("a", 2, system[:8] + ids(5), ids(4))  # compaction: history rewritten
    sub = call("a", 3, ids(10), ids(5))  # sub-agent: a fresh prompt
    b0 = call("b", 0, system, a0.completion_ids[:2] + ids(3))  # same first samples: extra terms
    b1 = call("b", 1, system + b0.completion_ids + ids(3), ids(4))
    return [a0, b0, a1, b1, a2, sub]


def per_call_reference(lm, calls: list[CallRecord]) -> tuple[dict, torch.Tensor]:
    """{(token path, rollout): logprob} and the gradient of the sum over all samples."""
    lm.zero_grad()
    out, total = {}, 0.0
    for c in calls:
        seq = c.prompt_ids + c.completion_ids
        logp = lm(torch.tensor([seq])).logits[0].float().log_softmax(-1)
        n_p = len(c.prompt_ids)
        for j, token in enumerate(c.completion_ids):
            value = logp[n_p + j - 1, token]
            out[(tuple(seq[: n_p + j + 1]), c.rollout_id)] = value.item()
            total = total + value
    total.backward()
    return out, torch.cat([p.grad.flatten() for p in lm.parameters()])


def packed_logprobs(lm, merged, batches, chunk_tokens: int) -> tuple[dict, torch.Tensor]:
    lm.zero_grad()
    wrapper = PackedLM(lm)
    out, total = {}, 0.0
    for mb in batches:
        terms = loss_terms(mb)
        logp = wrapper(**batch_tensors(mb, terms, "cpu"), chunk_tokens=chunk_tokens)
        for pos, r, value in zip(terms.position, terms.rollout, logp.tolist()):
            chain = [int(pos)]
            while mb.parent[chain[-1]] >= 0:
                chain.append(int(mb.parent[chain[-1]]))
            key = (tuple(int(mb.tokens[i]) for i in reversed(chain)), merged.rollout_ids[r])
            assert key not in out, "a sample counted twice"
            out[key] = value
        total = total + logp.sum()
    total.backward()
    return out, torch.cat([p.grad.flatten() for p in lm.parameters()])


def tiny_llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).float().eval()


def tiny_qwen35(attn: str = "sdpa", *, long_memory: bool = False):
    """long_memory: every Gated DeltaNet head decays slowly (exp(g) ~ 0.99 per token), as the
    long-memory heads of a trained model do; the default init forgets within a few tokens, which
    makes a leaked or lost state small."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                            max_position_embeddings=256, attn_implementation=attn)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    lm = Qwen3_5ForCausalLM(cfg).float().eval()
    if long_memory:
        with torch.no_grad():
            for layer in lm.model.layers[:3]:
                layer.linear_attn.A_log.fill_(np.log(0.05))
                layer.linear_attn.dt_bias.fill_(-2.0)
    return lm


def test_dense_mask_is_ancestor_rule():
    # tree: 0 -> 1 -> {2, 3}; node 1's subtree has size 3
    size = torch.tensor([4, 3, 1, 1])
    m = dense_mask(size)[0, 0]
    assert m.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, True, False, True],  # 3 sees its ancestors 0, 1 but not its sibling 2
    ]


@pytest.mark.parametrize("impl", merge_impls(), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("layout", ["tree", "paths"])
@pytest.mark.parametrize(("max_tokens", "attn"), [(4096, "sdpa"), (40, "sdpa"), (4096, "eager")])
def test_packed_equals_per_call_tiny(impl, layout, max_tokens, attn):
    lm = tiny_llama(attn)
    calls = branchy_calls(np.random.default_rng(1), lm.config.vocab_size)
    ref, ref_grad = per_call_reference(lm, calls)
    merged = impl.merge(calls, layout=layout)
    batches = impl.pack(merged, max_tokens=max_tokens)
    got, grad = packed_logprobs(lm, merged, batches, chunk_tokens=5)
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-5
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-4)
    if layout == "tree" and max_tokens == 4096:
        assert merged.stats.n_extra_samples == 2 and merged.stats.n_breaks >= 2
        assert len(merged.tokens) < sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)


@pytest.fixture(scope="module")
def smollm2():
    from polar_fast.model import load_model

    return load_model().eval()


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~10 s alone; a shared 2-core box has seen 80 s
@pytest.mark.parametrize("layout", ["tree", "paths"])
def test_packed_equals_per_call_smollm2(smollm2, layout):
    from polar_fast.model import load_tokenizer

    tok = load_tokenizer()
    text = tok.apply_chat_template([{"role": "system", "content": "You are a coding agent."},
                                    {"role": "user", "content": "Fix the failing test in foo.py"}],
                                   add_generation_prompt=True, tokenize=False)
    system = tok(text, add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(2)
    calls = branchy_calls(rng, 1000, prompt_len=8)
    calls = [msgspec_replace(c, prompt_ids=list(system) + c.prompt_ids) if c.call_index != 3 else c for c in calls]
    ref, ref_grad = per_call_reference(smollm2, calls)
    merged = merge_reference.merge(calls, layout=layout)
    got, grad = packed_logprobs(smollm2, merged, merge_reference.pack(merged, max_tokens=4096), 16)
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-4
    torch.testing.assert_close(grad, ref_grad, atol=1e-4, rtol=1e-3)


def msgspec_replace(call: CallRecord, **changes) -> CallRecord:
    import msgspec

    return msgspec.structs.replace(call, **changes)


def test_term_at_sequence_root_is_rejected():
    mb = merge_reference.pack(merge_reference.merge(branchy_calls(np.random.default_rng(0), 50)), max_tokens=4096)[0]
    terms = loss_terms(mb)
    bad = terms._replace(position=np.array([0]))
    with pytest.raises(ValueError, match="sequence root"):
        batch_tensors(mb, bad, "cpu")


def plan_as_mask(p, t: int) -> torch.Tensor:
    """The (T, T) mask a packed-attention plan computes, failing if a pair is computed twice."""
    seen = torch.zeros(t, t, dtype=torch.int64)
    key_index = torch.arange(t) if p.key_index is None else p.key_index
    queries = torch.arange(t).split(p.sizes)
    for q, keys, mask in zip(queries, key_index.split(p.key_sizes), p.masks, strict=True):
        if mask is None:
            assert torch.equal(keys, q), "a causal block sees exactly its queries"
            mask = torch.ones(len(q), len(q), dtype=torch.bool).tril()
        else:
            mask = mask == 0  # additive: 0 where allowed, -inf elsewhere
        seen[q[:, None], keys[None, :]] += mask.long()
    assert seen.max() <= 1
    return seen.bool()


@pytest.mark.parametrize("layout", ["tree", "paths"])
@pytest.mark.parametrize(("block_tokens", "merge_tokens"), [(256, 32), (4, 2), (7, 1), (3, 8)])
def test_packed_attention_plan_is_ancestor_rule(layout, block_tokens, merge_tokens):
    rng = np.random.default_rng(5)
    calls = branchy_calls(rng, 50) + branchy_calls(rng, 50, prompt_len=60)
    mb = merge_reference.pack(merge_reference.merge(calls, layout=layout), max_tokens=4096)[0]
    size = torch.as_tensor(np.asarray(mb.size, dtype=np.int64))
    p = packed_attention.plan(size, torch.float32, block_tokens, merge_tokens)
    assert sum(p.sizes) == len(size)
    assert torch.equal(plan_as_mask(p, len(size)), dense_mask(size)[0, 0])
    if layout == "paths" and merge_tokens == 1:  # nothing merged: one causal block per sequence, no gather
        assert p.key_index is None and p.masks == [None] * (len(mb.offsets) - 1)


@pytest.mark.parametrize("layout", ["tree", "paths"])
@pytest.mark.parametrize(("block_tokens", "merge_tokens"), [(256, 32), (4, 2)])
def test_packed_attention_equals_per_call(monkeypatch, layout, block_tokens, merge_tokens):
    monkeypatch.setattr(packed_attention, "BLOCK_TOKENS", block_tokens)
    monkeypatch.setattr(packed_attention, "MERGE_TOKENS", merge_tokens)
    lm = tiny_llama()
    calls = branchy_calls(np.random.default_rng(1), lm.config.vocab_size)
    ref, ref_grad = per_call_reference(lm, calls)
    lm.set_attn_implementation(packed_attention.NAME)
    merged = merge_reference.merge(calls, layout=layout)
    got, grad = packed_logprobs(lm, merged, merge_reference.pack(merged, max_tokens=4096), chunk_tokens=5)
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-5
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["tree", "paths"])
@pytest.mark.parametrize(("max_tokens", "attn"), [(4096, "sdpa"), (40, "sdpa"), (4096, packed_attention.NAME)])
def test_packed_equals_per_call_tiny_qwen35(layout, max_tokens, attn):
    lm = tiny_qwen35()
    calls = branchy_calls(np.random.default_rng(1), lm.config.vocab_size)
    ref, ref_grad = per_call_reference(lm, calls)
    lm.set_attn_implementation(attn)
    merged = merge_impls()[-1].merge(calls, layout=layout)
    batches = merge_impls()[-1].pack(merged, max_tokens=max_tokens)
    got, grad = packed_logprobs(lm, merged, batches, chunk_tokens=5)
    assert set(got) == set(ref)
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-5
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["tree", "paths"])
def test_packed_equals_per_call_tiny_qwen3_next(layout):
    """Qwen3-Next: the same Gated DeltaNet kernels behind other projections, MoE MLPs."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
                          linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                          max_position_embeddings=256)
    lm = Qwen3NextForCausalLM(cfg).float().eval()
    calls = branchy_calls(np.random.default_rng(1), lm.config.vocab_size)
    ref, ref_grad = per_call_reference(lm, calls)
    merged = merge_reference.merge(calls, layout=layout)
    got, grad = packed_logprobs(lm, merged, merge_reference.pack(merged, max_tokens=4096), chunk_tokens=5)
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-5
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("removed", ["scan state", "conv inputs", "state gradient"])
def test_tree_qwen35_needs_the_state_hand_over(monkeypatch, removed):
    """A tree segment starting from zeros instead of its parent's final scan state or conv
    inputs gives wrong logprobs, and a handed-over state cut off from autograd gives wrong
    gradients: the hand-over, gradients included, is what makes the tree exact."""
    import dataclasses

    from polar_fast.learner import packed_recurrence

    real_plan = packed_recurrence.plan

    def without_hand_over(size):
        seg = real_plan(size)
        if removed == "scan state":
            levels = [[dataclasses.replace(c, parent_row=None) for c in level] for level in seg.levels]
            return dataclasses.replace(seg, levels=levels)
        return dataclasses.replace(seg, parent=np.where(seg.offset == 0, -1, seg.parent))

    real_scan = packed_recurrence.packed_scan

    def detached_scan(kernel, *args, **kwargs):
        def detached(*a, initial_state=None, **k):
            return kernel(*a, initial_state=None if initial_state is None else initial_state.detach(), **k)
        return real_scan(detached, *args, **kwargs)

    if removed == "state gradient":
        monkeypatch.setattr(packed_recurrence, "packed_scan", detached_scan)
    else:
        monkeypatch.setattr(packed_recurrence, "plan", without_hand_over)
    lm = tiny_qwen35(long_memory=True)
    calls = branchy_calls(np.random.default_rng(1), lm.config.vocab_size)
    ref, ref_grad = per_call_reference(lm, calls)
    merged = merge_reference.merge(calls, layout="tree")
    got, grad = packed_logprobs(lm, merged, merge_reference.pack(merged, max_tokens=4096), chunk_tokens=5)
    logp_gap, grad_gap = max(abs(got[k] - ref[k]) for k in ref), (grad - ref_grad).abs().max().item()
    if removed == "state gradient":
        assert logp_gap < 1e-5 and grad_gap > 1e-3
    else:
        assert logp_gap > 1e-3


def test_packed_attention_without_a_plan_is_sdpa_on_the_given_mask():
    lm = tiny_llama()
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    want = lm(tokens).logits
    lm.set_attn_implementation(packed_attention.NAME)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(lm(tokens, attention_mask=causal).logits, want)
    with pytest.raises(ValueError, match="packed_plan"):
        lm(tokens)


def test_flex_attention_runs_on_a_class_that_does_not_declare_it():
    """transformers 5.25's Qwen3.5 refuses set_attn_implementation("flex_attention") (found on an
    H200 by bench/gpu_check.py); the learner runs transformers' own flex function under its name
    (FLEX) on the BlockMask, the recurrent layers given no mask. Forward only: CPU has no flex
    backward."""
    from polar_fast import merge
    from polar_fast.config import LearnerConfig
    from polar_fast.grpo import _attention_impl
    from polar_fast.learner import packed_forward

    lm = tiny_qwen35()
    assert not lm._supports_flex_attn
    assert _attention_impl(LearnerConfig(attention="flex_attention"), torch.device("cpu"), lm) == packed_forward.FLEX
    assert _attention_impl(LearnerConfig(attention="flex_attention"), torch.device("cpu"), tiny_llama()) == "flex_attention"
    calls = branchy_calls(np.random.default_rng(3), 211)
    mb = merge.pack(merge.merge(calls, layout="tree", impl="reference"), max_tokens=4096, impl="reference")[0]
    inputs = batch_tensors(mb, loss_terms(mb), "cpu")
    with torch.no_grad():
        reference = PackedLM(lm)(**inputs)
        lm.set_attn_implementation(packed_forward.FLEX)
        flex = PackedLM(lm)(**inputs)
    torch.testing.assert_close(flex, reference, atol=1e-5, rtol=0)


def test_packed_conv_keeps_the_convs_dtype_under_autocast(monkeypatch):
    """Under bf16 autocast the conv runs in bf16 and the rows recomputed at segment starts in fp32;
    CUDA's index_copy refuses the mix (found on an H200 by bench/gpu_check.py) where CPU's
    promotes it, so here index_copy is made as strict as CUDA's."""
    from polar_fast.learner import packed_recurrence

    real = torch.Tensor.index_copy

    def strict(self, dim, index, source):
        assert self.dtype == source.dtype, f"index_copy of {source.dtype} into {self.dtype}"
        return real(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy", strict)
    torch.manual_seed(0)
    hidden, weight = torch.randn(1, 8, 12), torch.randn(8, 4)
    segments = packed_recurrence.plan(torch.tensor([12, 11, 10, 9, 8, 3, 2, 1, 4, 3, 2, 1]))  # a trunk, two branches
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = packed_recurrence.packed_conv1d(hidden, weight, None, "silu", segments)
    assert out.shape == hidden.shape
