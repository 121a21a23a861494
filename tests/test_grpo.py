"""The learner step: layouts agree, infra/flat groups cost nothing, checkpoints resume exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_packed_forward import branchy_calls, tiny_llama, tiny_qwen35

from polar_fast.config import LearnerConfig
from polar_fast.grpo import Learner
from polar_fast.records import Outcome, RolloutRecord
from polar_fast.testing import groups_of


def rollouts(rewards: dict[str, float | None]) -> list[RolloutRecord]:
    return [RolloutRecord(rollout_id=r, group_id="g", task_id="t", harness="h",
                          outcome=Outcome.INFRA_ERROR if v is None else Outcome.OK, reward=v)
            for r, v in rewards.items()]


def learner(layout: str = "tree", **cfg) -> Learner:
    cfg.setdefault("lr", 1e-3)
    return Learner(LearnerConfig(**cfg), tiny_llama(), layout=layout, max_tokens=48, merge_impl="reference")


def params(lrn: Learner) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in lrn.policy.parameters()])


def test_layouts_take_the_same_step():
    calls = branchy_calls(np.random.default_rng(3), 211)
    rs = rollouts({"a": 1.0, "b": 0.0})
    results = {}
    for layout in ("percall", "paths", "tree"):
        lrn = learner(layout)
        m = lrn.step(groups_of(calls, rs))
        results[layout] = (m, params(lrn))
    base_m, base_p = results["percall"]
    assert base_m.n_terms == sum(len(c.completion_ids) for c in calls)
    assert base_m.grad_norm > 0 and math.isfinite(base_m.loss)
    for layout in ("paths", "tree"):
        m, p = results[layout]
        assert m.n_terms == base_m.n_terms
        assert m.loss == pytest.approx(base_m.loss, abs=1e-6)
        assert m.grad_norm == pytest.approx(base_m.grad_norm, rel=1e-4)
        torch.testing.assert_close(p, base_p, atol=1e-6, rtol=0)
    assert results["tree"][0].n_tokens <= results["paths"][0].n_tokens < results["percall"][0].n_tokens


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_hybrid_model_layouts_take_the_same_step(gradient_checkpointing):
    """Qwen3.5 (Gated DeltaNet + full attention): the learner's packed step equals per-call
    training, with its recurrent layers recomputed in backward too."""
    torch.set_num_threads(1)  # tiny model: more threads only spin-wait
    calls = branchy_calls(np.random.default_rng(3), 211)
    rs = rollouts({"a": 1.0, "b": 0.0})
    results = {}
    for layout in ("percall", "paths", "tree"):
        lrn = Learner(LearnerConfig(lr=1e-3, gradient_checkpointing=gradient_checkpointing), tiny_qwen35(),
                      layout=layout, max_tokens=48, merge_impl="reference")
        results[layout] = (lrn.step(groups_of(calls, rs)), params(lrn))
    base_m, base_p = results["percall"]
    for layout in ("paths", "tree"):
        m, p = results[layout]
        assert m.loss == pytest.approx(base_m.loss, abs=1e-6)
        assert m.grad_norm == pytest.approx(base_m.grad_norm, rel=1e-4)
        # AdamW's first step moves a weight by ~lr * g / |g|: where a gradient is ~0 its fp32 rounding
        # (the scan's chunking differs per layout) shows up as a few 1e-6 weight differences
        torch.testing.assert_close(p, base_p, atol=1e-5, rtol=0)


def test_bfloat16_autocast_layouts_agree():
    # CPU autocast: packed attention's float32 masks go through SDPA's autocast with the queries
    calls = branchy_calls(np.random.default_rng(3), 211)
    rs = rollouts({"a": 1.0, "b": 0.0})
    got = {layout: learner(layout, dtype="bfloat16").step(groups_of(calls, rs)) for layout in ("percall", "tree")}
    assert math.isfinite(got["tree"].loss) and got["tree"].grad_norm > 0
    assert got["tree"].loss == pytest.approx(got["percall"].loss, abs=1e-2)


def test_gradient_checkpointing_takes_the_same_step():
    calls = branchy_calls(np.random.default_rng(3), 211)
    rs = rollouts({"a": 1.0, "b": 0.0})
    plain, ckpt = learner(), learner(gradient_checkpointing=True)
    assert plain.step(groups_of(calls, rs)).loss == ckpt.step(groups_of(calls, rs)).loss
    torch.testing.assert_close(params(ckpt), params(plain), atol=1e-7, rtol=0)


def test_step_moves_policy_toward_advantage():
    calls = branchy_calls(np.random.default_rng(4), 211)
    rs = rollouts({"a": 1.0, "b": 0.0})
    lrn = learner("tree", lr=3e-3)
    before = lrn.prepare(groups_of(calls, rs))
    first = lrn.train_step(before)
    for _ in range(3):
        last = lrn.train_step(before)
    # ratio-weighted objective falls as "a" tokens get likelier and "b" tokens less likely
    assert last.pg_loss < first.pg_loss
    assert lrn.version == 4 and last.step == 4


def test_infra_and_flat_groups_train_nothing():
    calls = branchy_calls(np.random.default_rng(5), 211)
    lrn = learner()
    before = params(lrn)
    m = lrn.step(groups_of(calls, rollouts({"a": 1.0, "b": None})))  # "b" is infra: "a" alone has no group
    assert m.n_terms == 0 and m.n_micro_batches == 0 and m.reward_mean == 1.0
    torch.testing.assert_close(params(lrn), before)


def test_kl_term_starts_at_zero():
    calls = branchy_calls(np.random.default_rng(6), 211)
    lrn = learner(kl_coef=0.1)
    m = lrn.step(groups_of(calls, rollouts({"a": 1.0, "b": 0.0})))
    assert m.kl == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    m = lrn.step(groups_of(calls, rollouts({"a": 1.0, "b": 0.0})))
    assert m.kl > 0


def test_checkpoint_resume_is_exact(tmp_path):
    calls = branchy_calls(np.random.default_rng(7), 211)
    rs = rollouts({"a": 0.0, "b": 1.0})
    a = learner()
    a.step(groups_of(calls, rs))
    a.save(str(tmp_path))
    draw_a = torch.rand(3)
    a.step(groups_of(calls, rs))

    b = learner()
    assert b.resume(str(tmp_path))
    assert (b.step_count, b.version) == (1, 1)
    torch.testing.assert_close(torch.rand(3), draw_a)  # RNG restored
    b.step(groups_of(calls, rs))
    torch.testing.assert_close(params(b), params(a), atol=0, rtol=0)
    assert not learner().resume(str(tmp_path / "empty"))
