"""The learner memory estimate, made from a model's config alone, against a real learner step:
weights, gradients, optimizer state and the KL reference are the bytes of the actual tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_grpo import rollouts
from test_packed_forward import branchy_calls, tiny_llama

from polar_fast.config import LearnerConfig, parse_config
from polar_fast.grpo import Learner
from polar_fast.learner.memory import estimate_memory
from polar_fast.testing import groups_of


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tied", [False, True])
def test_estimate_equals_the_tensors_of_a_real_step(tmp_path, tied):
    model = tiny_llama()
    if tied:  # as SmolLM2: the LM head is the embedding
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model.config.save_pretrained(tmp_path)  # config.json only: no weights for the estimate to read
    cfg = parse_config({"model": {"path": str(tmp_path)}, "merge": {"max_tokens": 48},
                        "learner": {"kl_coef": 0.1, "lr": 1e-3}})
    estimate = estimate_memory(cfg)

    learner = Learner(LearnerConfig(kl_coef=0.1, lr=1e-3, check_packed=False), model, max_tokens=48,
                      merge_impl="reference")
    grads: list[int] = []
    learner.optimizer.register_step_pre_hook(  # the gradients exist until the step zeroes them
        lambda opt, *_: grads.append(tensor_bytes(p.grad for p in learner.policy.parameters())))
    metrics = learner.step(groups_of(branchy_calls(np.random.default_rng(3), 211), rollouts({"a": 1.0, "b": 0.0})))
    assert metrics.n_terms > 0 and grads

    params = list(learner.policy.parameters())
    state = [t for s in learner.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert len(learner.optimizer.state) == len(params)  # every parameter took the step
    assert estimate.params == sum(p.numel() for p in params)
    assert estimate.weights == tensor_bytes(params)
    assert estimate.gradients == grads[0]
    assert estimate.optimizer == tensor_bytes(state)
    assert estimate.reference == tensor_bytes(learner.ref.parameters())
    assert estimate.gathered == 0 and estimate.world == 1


def test_sharding_divides_the_states_and_checkpointing_the_activations(tmp_path):
    tiny_llama().config.save_pretrained(tmp_path)
    cfg = parse_config({"model": {"path": str(tmp_path)}, "merge": {"max_tokens": 65536},
                        "learner": {"dtype": "bfloat16"}})
    one, four = estimate_memory(cfg), estimate_memory(cfg, world=4)
    assert four.weights < one.weights / 3 and four.optimizer < one.optimizer / 3 and four.gathered > 0
    assert one.activations_checkpointed < one.activations  # two layers: one is recomputed at a time
    assert one.total_bytes(checkpointing=True) < one.total_bytes(checkpointing=False)


def test_the_memory_bench_runs_a_real_step_and_counts_it_exactly(tmp_path):
    """bench/memory_bench.py's smoke row (the H200 numbers in docs/gpu.md come from its cuda rows)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import memory_bench

    row = memory_bench.row("tiny", 256, True, "cpu", tmp_path)
    assert row["weights_ok"] and row["optimizer_ok"] and row["estimate_GiB"] > 0
