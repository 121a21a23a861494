"""GRPO loss parts as pure functions: advantages, the clipped token loss, KL, aggregation.

Choices (the learner's docstring repeats them with the reasons):
- Advantages are per rollout, computed once from the group's rewards and spread over every
  sequence the rollout produced. `mean_std`: (r - mean) / (std + eps) with the sample std
  (ddof=1, as TRL's GRPO); `mean`: r - mean (Dr. GRPO, no std division); `leave_one_out`:
  r_i - mean of the others (RLOO). Groups whose rewards are all equal carry no signal and are
  skipped; infra_error rollouts never enter group statistics (they have no reward).
- Token loss: PPO clip with separate bounds (clip-higher, DAPO) on the ratio against the
  recorded behaviour logprob, plus a cap on the importance weight for negative advantages
  (dual-clip): a token the policy now likes far more than the sampler did cannot dominate.
  Beyond the cap the term is constant, so it gives no gradient.
- Engine/learner mismatch correction (`policy_loss`): "none" takes the PPO ratio against the
  behaviour logprob; "tis" and "mask" are decoupled PPO: the ratio is against pi_old, the learner's
  own detached logprob at the step's first forward (1 before the update), and a detached weight
  from pi_old / pi_behaviour multiplies the policy term, truncated at a cap (tis) or zero outside a
  band (mask: per token, or per rollout on the geometric mean). The ratio is never applied twice.
- KL to a reference (off by default): the k3 estimator exp(ref - logp) - (ref - logp) - 1,
  non-negative and unbiased for KL(pi || ref). The same estimator measures the mismatch,
  KL(behaviour || learner), from the tokens the engine sampled (`mismatch_terms`).
- Aggregation is "mean over keys of the mean within a key": per-rollout keys (default: each
  rollout weighs the same however many sequences or micro-batches it was split into),
  sequence keys (sequence-mean), or one key (token-mean).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Sequence

import torch

from polar_fast.records import Outcome, RolloutRecord

AdvantageMode = Literal["mean_std", "mean", "leave_one_out"]
Aggregation = Literal["per-rollout", "token-mean", "sequence-mean"]
AGGREGATIONS: tuple[str, ...] = ("per-rollout", "token-mean", "sequence-mean")
Correction = Literal["none", "tis", "mask"]
STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], mode: AdvantageMode) -> list[float] | None:
    """Advantages of one group's rewards, or None when the group carries no signal.

    None for fewer than two rewards or when all rewards are equal (zero variance)."""
    n = len(rewards)
    if n < 2 or max(rewards) == min(rewards):
        return None
    mean = sum(rewards) / n
    if mode == "mean":
        return [r - mean for r in rewards]
    if mode == "mean_std":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        return [(r - mean) / (std + STD_EPS) for r in rewards]
    if mode == "leave_one_out":
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    raise ValueError(f"advantage mode must be one of mean_std, mean, leave_one_out; got {mode!r}")


def rollout_advantages(rollouts: Sequence[RolloutRecord], mode: AdvantageMode) -> dict[str, float]:
    """rollout_id -> advantage for every rollout worth training on.

    Rollouts are grouped by group_id; infra_error rollouts (and any without a reward) are left
    out of their group's statistics and of the result, as are zero-variance groups."""
    groups: dict[str, list[RolloutRecord]] = {}
    for r in rollouts:
        if r.outcome == Outcome.INFRA_ERROR or r.reward is None:
            continue
        groups.setdefault(r.group_id, []).append(r)
    out: dict[str, float] = {}
    for members in groups.values():
        adv = group_advantages([float(r.reward) for r in members], mode)
        if adv is not None:
            out.update((r.rollout_id, a) for r, a in zip(members, adv))
    return out


def ppo_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantage: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_importance_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-term clipped policy-gradient loss and a 0/1 "was clipped" flag.

    logp, behaviour_logp, advantage: (N,). Returns (loss (N,), clipped (N,) float).
    loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), then for A < 0 capped at
    -A * max_importance_weight (dual clip; inf disables)."""
    if max_importance_weight <= 1.0 + clip_high:
        raise ValueError(
            f"max_importance_weight ({max_importance_weight}) must exceed 1 + clip_high ({1 + clip_high})"
        )
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = -advantage * ratio
    clipped = -advantage * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    capped = torch.where(advantage < 0, torch.minimum(loss, -advantage * max_importance_weight), loss)
    was_clipped = (capped != unclipped).float()
    return capped, was_clipped


class PolicyLoss(NamedTuple):
    """One micro-batch's policy terms, each (N,)."""

    loss: torch.Tensor  # per-term loss, the importance weight applied
    clipped: torch.Tensor  # 1 where the PPO clip or the dual-clip cap changed the term
    ratio: torch.Tensor  # the PPO ratio the clip saw (detached)
    weight: torch.Tensor  # the detached importance weight on the term (1 under "none")
    corrected: torch.Tensor  # 1 where tis truncated the weight or mask dropped the term


def importance_weights(log_ratio: torch.Tensor, correction: Correction, *, cap: float, low: float, high: float,
                       rollout_log_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached weight (N,) on each policy term, and a 0/1 flag (N,) where the correction
    changed it. log_ratio = log pi_old - log pi_behaviour (N,).

    none: 1. tis: min(exp(log_ratio), cap). mask: exp(log_ratio) inside [low, high], else 0; with
    rollout_log_ratio (N,: the mean log ratio over each term's rollout, so exp of it is the
    rollout's geometric mean ratio) a term is also 0 when its rollout's geometric mean leaves the band."""
    ratio = torch.exp(log_ratio.detach())
    if correction == "none":
        return torch.ones_like(ratio), torch.zeros_like(ratio)
    if correction == "tis":
        return torch.clamp(ratio, max=cap), (ratio > cap).float()
    if correction != "mask":
        raise ValueError(f"is_correction must be none, tis or mask; got {correction!r}")
    keep = (ratio >= low) & (ratio <= high)
    if rollout_log_ratio is not None:
        geometric = torch.exp(rollout_log_ratio.detach())
        keep &= (geometric >= low) & (geometric <= high)
    return torch.where(keep, ratio, torch.zeros_like(ratio)), (~keep).float()


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantage: torch.Tensor,
    *,
    correction: Correction,
    clip_low: float,
    clip_high: float,
    max_importance_weight: float,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
    rollout_log_ratio: torch.Tensor | None = None,
) -> PolicyLoss:
    """The policy terms of one micro-batch under an engine/learner mismatch correction. All (N,).

    none: ppo_token_loss on pi_theta / pi_behaviour. tis, mask: ppo_token_loss on pi_theta / pi_old,
    pi_old = logp detached (this is the step's first forward, so the ratio is 1 and its gradient
    is grad log pi), times importance_weights(pi_old / pi_behaviour). max_importance_weight is the
    dual-clip cap on the PPO ratio in every mode; under tis and mask that ratio starts at 1, so
    the cap binds only on a ratio that moved past it, and the engine gap is bounded by `cap` or
    the band instead."""
    if correction == "none":
        loss, clipped = ppo_token_loss(logp, behaviour_logp, advantage, clip_low=clip_low, clip_high=clip_high,
                                       max_importance_weight=max_importance_weight)
        ones = torch.ones_like(loss)
        return PolicyLoss(loss, clipped, torch.exp(logp.detach() - behaviour_logp), ones, torch.zeros_like(loss))
    old = logp.detach()
    weight, corrected = importance_weights(old - behaviour_logp, correction, cap=cap, low=low, high=high,
                                           rollout_log_ratio=rollout_log_ratio)
    loss, clipped = ppo_token_loss(logp, old, advantage, clip_low=clip_low, clip_high=clip_high,
                                   max_importance_weight=max_importance_weight)
    return PolicyLoss(weight * loss, clipped, torch.exp(logp.detach() - old), weight, corrected)


def mismatch_terms(learner_logp: torch.Tensor, behaviour_logp: torch.Tensor, *, clip_low: float,
                   clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sampled token (N,): the k3 estimate of KL(behaviour || learner) (the tokens were sampled
    from the behaviour policy: r - 1 - log r with r = pi_learner / pi_behaviour, >= 0, unbiased),
    |log pi_learner - log pi_behaviour|, and 1 where r lies outside [1 - clip_low, 1 + clip_high]."""
    delta = (learner_logp.detach() - behaviour_logp).double()
    ratio = torch.exp(delta)
    outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return ratio - 1.0 - delta, delta.abs(), outside.double()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi || ref) per term: exp(ref - logp) - (ref - logp) - 1. Shapes (N,)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def aggregation_keys(
    mode: Aggregation, term_rollout: torch.Tensor, term_sequence: torch.Tensor
) -> torch.Tensor:
    """The key each term is averaged within. term_rollout, term_sequence: (N,) int, global ids."""
    if mode == "per-rollout":
        return term_rollout
    if mode == "sequence-mean":
        return term_sequence
    if mode == "token-mean":
        return torch.zeros_like(term_rollout)
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {mode!r}")


def mean_of_means_weights(keys: torch.Tensor) -> torch.Tensor:
    """Weights (N,) that sum to 1: each distinct key gets 1/n_keys, shared equally by its terms."""
    if keys.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    return 1.0 / (counts.numel() * counts[inverse].to(torch.float64))


def aggregate(
    term_loss: torch.Tensor,
    mode: Aggregation,
    *,
    term_rollout: torch.Tensor,
    term_sequence: torch.Tensor,
) -> torch.Tensor:
    """Scalar loss of one batch of terms under `mode` (see aggregation_keys). Shapes (N,)."""
    weights = mean_of_means_weights(aggregation_keys(mode, term_rollout, term_sequence))
    return (term_loss * weights.to(term_loss.dtype)).sum()
