"""Loss parts against hand-computed values: advantages, clipping, caps, KL, aggregation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polar_fast.config import LearnerConfig
from polar_fast.grpo import build_step_batch
from polar_fast.learner import losses
from polar_fast.records import CallRecord, Outcome, RolloutRecord
from polar_fast.testing import groups_of


def test_group_advantages_by_mode():
    # rewards 1,0,0,1: mean .5, sample std sqrt(1/3)
    adv = losses.group_advantages([1, 0, 0, 1], "mean_std")
    assert adv == pytest.approx([0.5 / math.sqrt(1 / 3)] * 1 + [-0.5 / math.sqrt(1 / 3)] * 2 + [0.5 / math.sqrt(1 / 3)], rel=1e-5)
    assert losses.group_advantages([1, 0, 0, 1], "mean") == [0.5, -0.5, -0.5, 0.5]
    # leave-one-out: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    assert losses.group_advantages([1, 0, 0], "leave_one_out") == [1.0, -0.5, -0.5]
    assert losses.group_advantages([0.3, 0.3, 0.3], "mean_std") is None  # zero variance: skipped
    assert losses.group_advantages([1.0], "mean") is None
    with pytest.raises(ValueError, match="advantage mode"):
        losses.group_advantages([0, 1], "median")


def _rollout(rid: str, group: str, reward: float | None, outcome: Outcome = Outcome.OK) -> RolloutRecord:
    return RolloutRecord(rollout_id=rid, group_id=group, task_id="t", harness="h", outcome=outcome, reward=reward)


def test_rollout_advantages_skip_infra_and_flat_groups():
    rollouts = [
        _rollout("a", "g1", 1.0), _rollout("b", "g1", 0.0),
        _rollout("c", "g1", None, Outcome.INFRA_ERROR),  # not part of g1's statistics
        _rollout("d", "g2", 1.0), _rollout("e", "g2", 1.0),  # flat group
        _rollout("f", "g2", 0.0, Outcome.INFRA_ERROR),  # infra reward ignored even if set
    ]
    adv = losses.rollout_advantages(rollouts, "mean")
    assert adv == {"a": 0.5, "b": -0.5}


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "clipped"),
    [
        (1.0, 1.0, -1.0, 0.0),
        (1.5, 1.0, -1.28, 1.0),  # clip-high bound 1 + 0.28
        (0.5, 1.0, -0.5, 0.0),  # A > 0 and ratio low: unclipped (pessimistic min)
        (0.5, -1.0, 0.8, 1.0),  # A < 0 and ratio low: clip-low bound 1 - 0.2
        (1.5, -1.0, 1.5, 0.0),  # A < 0, ratio high, under the cap
        (3.0, -1.0, 2.0, 1.0),  # dual-clip cap at max_importance_weight = 2
        (3.0, 2.0, -2.56, 1.0),
    ],
)
def test_ppo_token_loss_hand_values(ratio, adv, loss, clipped):
    logp = torch.tensor([math.log(ratio) - 0.7])
    out, was = losses.ppo_token_loss(logp, torch.tensor([-0.7]), torch.tensor([adv]),
                                     clip_low=0.2, clip_high=0.28, max_importance_weight=2.0)
    assert out.item() == pytest.approx(loss, rel=1e-5)
    assert was.item() == clipped


def test_ppo_gradients_vanish_where_clipped():
    logp = torch.tensor([math.log(1.5), math.log(3.0), math.log(1.1)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0])
    out, _ = losses.ppo_token_loss(logp, torch.zeros(3), adv, clip_low=0.2, clip_high=0.28,
                                   max_importance_weight=2.0)
    out.sum().backward()
    # d(-A r)/dlogp = -A r: zero for the two clipped terms, -1.1 for the unclipped one
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -1.1])


def test_cap_must_exceed_clip_high():
    with pytest.raises(ValueError, match="max_importance_weight"):
        losses.ppo_token_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), clip_low=0.2,
                              clip_high=0.28, max_importance_weight=1.2)


# pi_old / pi_behaviour per term, under each correction (cap 2, band [0.5, 2]): (weight, corrected)
@pytest.mark.parametrize(
    ("correction", "ratio", "weight", "corrected"),
    [
        ("none", 3.0, 1.0, 0.0),
        ("tis", 1.5, 1.5, 0.0),
        ("tis", 0.25, 0.25, 0.0),  # truncated above only
        ("tis", 3.0, 2.0, 1.0),  # min(ratio, cap)
        ("mask", 1.5, 1.5, 0.0),  # inside the band: the ratio itself
        ("mask", 0.4, 0.0, 1.0),
        ("mask", 3.0, 0.0, 1.0),
    ],
)
def test_importance_weights_hand_values(correction, ratio, weight, corrected):
    w, c = losses.importance_weights(torch.tensor([math.log(ratio)]), correction, cap=2.0, low=0.5, high=2.0)
    assert w.item() == pytest.approx(weight, rel=1e-6) and c.item() == corrected


def test_rollout_mask_drops_a_rollout_whose_geometric_mean_leaves_the_band():
    # rollout 0: ratios 1.2 and 4 (geometric mean sqrt(4.8) = 2.19 > 2); rollout 1: 0.9 and 1.5 (1.16)
    ratio = torch.tensor([1.2, 4.0, 0.9, 1.5])
    per_rollout = torch.tensor([math.log(4.8) / 2] * 2 + [math.log(1.35) / 2] * 2)
    token, _ = losses.importance_weights(ratio.log(), "mask", cap=2.0, low=0.5, high=2.0)
    whole, dropped = losses.importance_weights(ratio.log(), "mask", cap=2.0, low=0.5, high=2.0,
                                               rollout_log_ratio=per_rollout)
    assert token.tolist() == pytest.approx([1.2, 0.0, 0.9, 1.5])
    assert whole.tolist() == pytest.approx([0.0, 0.0, 0.9, 1.5]) and dropped.tolist() == [1, 1, 0, 0]


def _policy_grad(correction: str, ratio: float, adv: float) -> tuple[float, float]:
    """(loss, d loss / d logp) of one term whose learner/behaviour ratio is `ratio`."""
    logp = torch.tensor([-0.7], requires_grad=True)
    out = losses.policy_loss(logp, torch.tensor([-0.7 - math.log(ratio)]), torch.tensor([adv]),
                             correction=correction, clip_low=0.2, clip_high=0.28, max_importance_weight=2.0,
                             cap=2.0, low=0.5, high=2.0)
    out.loss.sum().backward()
    return out.loss.item(), logp.grad.item()


@pytest.mark.parametrize(
    ("correction", "ratio", "adv", "loss", "grad"),
    [
        # a positive advantage whose engine gap is past the clip: none clips it, tis keeps it weighted
        ("none", 1.5, 1.0, -1.28, 0.0),
        ("tis", 1.5, 1.0, -1.5, -1.5),  # -A w, w = 1.5: the ratio is applied once, not 1.5 x 1.5
        ("mask", 1.5, 1.0, -1.5, -1.5),
        ("tis", 3.0, 1.0, -2.0, -2.0),  # truncated at the cap
        ("mask", 3.0, 1.0, 0.0, 0.0),  # dropped
        # a negative advantage below the clip: none clips it, tis keeps it weighted
        ("none", 0.5, -1.0, 0.8, 0.0),
        ("tis", 0.5, -1.0, 0.5, 0.5),
        ("mask", 0.4, -1.0, 0.0, 0.0),
        # inside the clip band all three take the same gradient, -A r
        ("none", 1.1, 1.0, -1.1, -1.1),
        ("tis", 1.1, 1.0, -1.1, -1.1),
        ("mask", 1.1, -1.0, 1.1, 1.1),
    ],
)
def test_policy_loss_hand_values(correction, ratio, adv, loss, grad):
    got_loss, got_grad = _policy_grad(correction, ratio, adv)
    assert got_loss == pytest.approx(loss, rel=1e-5) and got_grad == pytest.approx(grad, rel=1e-5, abs=1e-7)


def test_mismatch_terms_hand_values():
    # learner - behaviour = log 1.5, log 0.5, 0: k3 = r - 1 - log r; outside [0.8, 1.28] for the first two
    behaviour = torch.tensor([-1.0, -1.0, -2.0])
    learner = behaviour + torch.tensor([math.log(1.5), math.log(0.5), 0.0])
    k3, delta, outside = losses.mismatch_terms(learner, behaviour, clip_low=0.2, clip_high=0.28)
    assert k3.tolist() == pytest.approx([0.5 - math.log(1.5), -0.5 - math.log(0.5), 0.0], abs=1e-7)
    assert delta.tolist() == pytest.approx([math.log(1.5), math.log(2.0), 0.0], rel=1e-6)
    assert outside.tolist() == [1.0, 1.0, 0.0]


def test_kl_k3():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    # delta = ref - logp = 0 and 1: exp(0)-0-1 = 0, exp(1)-1-1
    assert losses.kl_k3(logp, ref).tolist() == pytest.approx([0.0, math.e - 2])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("per-rollout", ((1 + 2 + 3) / 3 + 4) / 2),
        ("sequence-mean", (1 + (2 + 3) / 2 + 4) / 3),
    ],
)
def test_aggregate_hand_values(mode, expected):
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0])
    got = losses.aggregate(loss, mode, term_rollout=torch.tensor([0, 0, 0, 1]),
                           term_sequence=torch.tensor([0, 1, 1, 2]))
    assert got.item() == pytest.approx(expected)


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="aggregation"):
        losses.aggregate(torch.ones(1), "sum", term_rollout=torch.zeros(1), term_sequence=torch.zeros(1))


def _calls() -> list[CallRecord]:
    """Rollout a: three calls, the last after a compaction (a branch); rollout b: one short call."""
    def call(rid, i, prompt, completion):
        return CallRecord(session_id=rid, rollout_id=rid, group_id="g", call_index=i, prompt_ids=prompt,
                          completion_ids=completion, completion_logprobs=[-0.5] * len(completion),
                          policy_version=0, finish_reason="stop", dialect="chat")
    p = list(range(10, 30))
    a0 = call("a", 0, p, [40, 41, 42, 43])
    a1 = call("a", 1, p + [40, 41, 42, 43, 50, 51], [44, 45, 46])
    a2 = call("a", 2, p[:5] + [60, 61, 62], [47, 48, 49, 52, 53])
    b0 = call("b", 0, p, [40, 70])
    return [a0, b0, a1, a2]


@pytest.mark.parametrize("layout", ["tree", "paths", "percall"])
@pytest.mark.parametrize("max_tokens", [32, 128])
def test_per_rollout_weight_independent_of_split(layout, max_tokens):
    rollouts = [_rollout("a", "g", 1.0), _rollout("b", "g", 0.0)]
    batch = build_step_batch(groups_of(_calls(), rollouts), LearnerConfig(), layout=layout, max_tokens=max_tokens,
                             merge_impl="reference")
    total = {0: 0.0, 1: 0.0}
    for keys, weights in zip(batch.keys_rollout, batch.weights):
        for k, w in zip(keys, weights):
            total[int(k)] += w
    assert total == pytest.approx({0: 0.5, 1: 0.5})  # each rollout weighs half, however split
    assert batch.n_terms == 4 + 3 + 5 + 2  # every sampled token is exactly one loss term
    if max_tokens == 32 and layout != "percall":
        assert len(batch.micro_batches) > 1


def test_token_mean_weights_are_uniform():
    rollouts = [_rollout("a", "g", 1.0), _rollout("b", "g", 0.0)]
    cfg = LearnerConfig(aggregation="token-mean")
    batch = build_step_batch(groups_of(_calls(), rollouts), cfg, layout="tree", max_tokens=32, merge_impl="reference")
    flat = np.concatenate(batch.weights)
    assert flat == pytest.approx(np.full(14, 1 / 14))
