"""The GRPO learner: finished groups in (rollouts/groups.py: rewards and captured calls), one
optimizer step on packed trie batches out.

    learner = Learner.from_config(cfg)
    metrics = learner.step(groups)          # a list of GroupRecord; gate=mismatch.Gate(...) at a run's first step
    await learner.sync_weights(sync)        # the engine serves the new policy version

Reads top to bottom, one section per stage: config -> setup (model, FSDP2, optimizer) -> packed
batches (advantages, merge, pack, loss terms, aggregation weights) -> loss (the GRPO objective;
the NLL objective of supervised fine-tuning beside it) -> step -> metrics -> weights/checkpoint.
`Learner`, at the end, holds the state those functions work on (model, optimizer, step counter,
policy version) and is what callers use. The layouts, the step batch and what every objective
shares live in learner/batches.py; the loss parts as pure tensor functions in learner/losses.py.

The variant, and where it deviates from paper GRPO (DeepSeekMath):
- One advantage per rollout (a whole harness run, many model calls), from the group's rewards:
  mean/std (default), mean only (Dr. GRPO) or leave-one-out (RLOO); spread over every token the
  rollout sampled. Zero-variance groups and infra_error rollouts are left out before merging,
  so they cost no compute.
- Training data is the prefix-trie merge of the group's calls, not one sequence per call:
  `tree` computes each shared prefix once (ancestor-rule attention, depth as position id),
  `paths` computes each leaf path once. Extra samples (the same token sampled by two rollouts
  after the same prefix) each add their own loss term at the shared position.
- Token-level PPO clip with clip-higher bounds, plus a dual-clip cap for negative advantages.
  The engine/learner mismatch is measured at every step's first forward, before the update
  (k3 KL(behaviour || learner), mean and max |delta logprob|, share outside the clip band:
  learner/mismatch.py) and corrected per `learner.is_correction`. Default "tis" (decoupled PPO):
  the PPO ratio is against pi_old, the learner's own detached logprob at that forward (one
  optimizer step per batch: 1 before the update), and a detached truncated importance weight
  min(pi_old / pi_behaviour, is_cap) multiplies the policy term, so a token the engine sampled
  under a slightly different distribution keeps its gradient instead of losing it to the clip.
  "none" is the paper's ratio against the recorded behaviour logprob; "mask" drops tokens (or
  rollouts) whose pi_old / pi_behaviour leaves a band. A run's first step can stop before the
  update when the mismatch is too large (the gate, learner/mismatch.py). KL to a frozen
  reference is off by default (k3 estimator when on).
- Logprobs at the run's sampling temperature (`logits / sampling.temperature`), the distribution
  the engine sampled and recorded its behaviour logprobs under, so the ratio is exact at any
  temperature; top-p truncation is not reproduced, so training refuses top_p < 1 (train.py).
- Loss normalised per rollout (default): every trained rollout weighs the same, however many
  calls, sequences or micro-batches it was split into; token-mean and sequence-mean available.
- One optimizer step per call of `step()`, gradients accumulated over micro-batches.

Distributed: under torchrun, the wrapped model is sharded with FSDP2 (`fully_shard` per decoder
layer, then the root); every rank builds the same step batch and takes micro-batches i::world
(ranks short of work run a zero-weight pass so collectives line up). The local loss is scaled by
world size because FSDP2 averages gradients over ranks while the aggregation weights already
sum to one over the whole step.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Iterator, Literal, Sequence

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from polar_fast import merge
from polar_fast.config import Config, LearnerConfig
from polar_fast.learner import losses, mismatch, packed_attention, packed_check, packed_forward
from polar_fast.learner.batches import LAYOUTS, StepBatch, check_layout, group_batches, percall_batches, split_weights
from polar_fast.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from polar_fast.learner.host_memory import fix_mmap_threshold
from polar_fast.learner.mismatch import Gate, MismatchError
from polar_fast.learner.packed_forward import PackedLM, batch_tensors, loss_terms
from polar_fast.learner.step_control import StepControl, StepInterrupted
from polar_fast.learner.weight_sync import WeightStream
from polar_fast.records import CallRecord, Outcome
from polar_fast.rollouts.groups import GroupRecord

__all__ = ["LAYOUTS", "Gate", "Learner", "MismatchError", "StepBatch", "StepControl", "StepInterrupted", "StepMetrics",
           "build_step_batch", "trains_on"]

Objective = Literal["grpo", "nll"]  # GRPO on group rewards; supervised fine-tuning (learner/sft.py)

# ------------------------------------------------------------------------------------- config


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _attention_impl(cfg: LearnerConfig, device: torch.device, model: torch.nn.Module) -> str:
    """"auto": FlexAttention on CUDA, SDPA per block (no (T, T) mask) elsewhere. A class whose
    transformers code does not declare FlexAttention (Qwen3.5's, in transformers 5.25: found by
    bench/gpu_check.py on an H200) gets transformers' flex function under our own name."""
    kind = cfg.attention
    if kind == "auto":
        kind = "flex_attention" if device.type == "cuda" else "sdpa"
    if kind == "flex_attention" and not getattr(model, "_supports_flex_attn", False):
        packed_forward.register_flex()
        return packed_forward.FLEX
    return packed_attention.NAME if kind == "sdpa" else kind


# -------------------------------------------------------------------------------------- setup


def _prepare_model(model: torch.nn.Module, cfg: LearnerConfig, *, layout: str, device: torch.device, world: int,
                   merge_impl: merge.Impl) -> bool:
    """Place the model, pick its attention, check that `layout` trains it exactly, turn on
    gradient checkpointing. Returns whether its parameters are on the meta device (model.empty_model:
    they are filled after sharding, by `_receive_weights`)."""
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and world == 1:
        raise ValueError("a model on the meta device needs torch.distributed ranks to shard it over")
    if not on_meta:
        model.to(device)
    attention = _attention_impl(cfg, device, model)
    model.set_attn_implementation(attention)
    if cfg.check_packed and layout != "percall":  # before any step: a layer that leaks stops the run
        packed_check.check(model, layout, attention=attention, device=device, merge_impl=merge_impl)
    if cfg.gradient_checkpointing:  # transformers 5 renamed it; older versions have only the first
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return on_meta


def _shard(policy: PackedLM, cfg: LearnerConfig, device: torch.device, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy()
    if cfg.dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in policy.lm.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)


def _receive_weights(policy: PackedLM, ref: PackedLM | None, full: torch.nn.Module | None, *,
                     device: torch.device, rank: int) -> None:
    """Materialise the sharded meta parameters on this rank's device and fill them from rank 0:
    each rank keeps only its shard (set_model_state_dict broadcasts tensor by tensor). The
    buffers no checkpoint holds (rotary frequencies) were built for real; they come along."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if (full is None) != (rank != 0):
        raise ValueError("rank 0, and only rank 0, gives the weights")
    lm = policy.lm
    buffers = {name: b.detach().clone() for name, b in lm.named_buffers()}
    policy.to_empty(device=device)
    state = full.state_dict() if full is not None else {}
    set_model_state_dict(lm, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    persistent = set(lm.state_dict())
    with torch.no_grad():
        for name, b in lm.named_buffers():
            if name not in persistent:
                b.copy_(buffers[name])
        if ref is not None:  # the frozen reference is whole on every rank: broadcast it
            ref.to_empty(device=device)
            source = full.state_dict() if full is not None else {}  # set_model_state_dict consumed `state`
            for name, t in ref.lm.state_dict().items():
                if rank == 0:
                    t.copy_(source[name])
                dist.broadcast(t, src=0)
            for name, b in ref.lm.named_buffers():
                if name in buffers and name not in persistent:
                    b.copy_(buffers[name])


def _optimizer(policy: PackedLM, cfg: LearnerConfig, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(  # fused: one kernel for all parameters (CPU and CUDA)
        policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
        fused=device.type in ("cpu", "cuda"),
    )


# ----------------------------------------------------------------------------- packed batches


def build_step_batch(
    groups: Sequence[GroupRecord],
    cfg: LearnerConfig,
    *,
    layout: str = "tree",
    max_tokens: int = 8192,
    merge_impl: merge.Impl = "rust",
) -> StepBatch:
    """Per group: advantages -> merge of the calls of the rollouts that have one -> pack; then
    loss terms and aggregation weights over the whole step."""
    check_layout(layout)
    per_group = [(g, losses.rollout_advantages(g.records, cfg.advantage)) for g in groups]
    advantages = {rid: a for _, adv in per_group for rid, a in adv.items()}
    scored = [r.reward for g in groups for r in g.records if r.outcome != Outcome.INFRA_ERROR and r.reward is not None]
    rollout_index = {rid: i for i, rid in enumerate(sorted(advantages))}
    mbs, terms, advs, keys_r, keys_s = [], [], [], [], []
    n_seq = 0
    for group, adv in per_group:
        group_calls = [c for r in group.rollouts if r.record.rollout_id in adv for c in r.sampled_calls]
        if not group_calls:
            continue
        for mb, rollout_ids in group_batches(group_calls, layout, max_tokens, merge_impl):
            t = loss_terms(mb)
            rids = [rollout_ids[i] for i in t.rollout]
            mbs.append(mb)
            terms.append(t)
            advs.append(np.array([advantages[r] for r in rids], np.float32))
            keys_r.append(np.array([rollout_index[r] for r in rids], np.int64))
            keys_s.append(t.sequence + n_seq)
            n_seq += len(mb.offsets) - 1
    weights = split_weights(cfg.aggregation, keys_r, keys_s)
    return StepBatch(mbs, terms, advs, weights, keys_r, n_rollouts=len({r for k in keys_r for r in k}),
                     reward_mean=float(np.mean(scored)) if scored else math.nan)


def trains_on(group: GroupRecord, cfg: LearnerConfig) -> bool:
    """Whether a step would train on any of this group's rollouts: the rule build_step_batch
    applies (scored rollouts, at least two, rewards not all equal)."""
    return bool(losses.rollout_advantages(group.records, cfg.advantage))


# --------------------------------------------------------------------------------------- loss


def grpo_objective(logp: torch.Tensor, behaviour: torch.Tensor, advantage: torch.Tensor, cfg: LearnerConfig, *,
                   rollout_log_ratio: torch.Tensor | None = None) -> losses.PolicyLoss:
    """The per-term GRPO policy terms (N,): the PPO clip with the run's bounds and dual-clip cap,
    under the run's mismatch correction (learner.is_correction; losses.policy_loss)."""
    return losses.policy_loss(logp, behaviour, advantage, correction=cfg.is_correction, clip_low=cfg.clip_low,
                              clip_high=cfg.clip_high, max_importance_weight=cfg.max_importance_weight,
                              cap=cfg.is_cap, low=cfg.is_mask_low, high=cfg.is_mask_high,
                              rollout_log_ratio=rollout_log_ratio)


def nll_objective(logp: torch.Tensor) -> losses.PolicyLoss:
    """Supervised fine-tuning (learner/batches.nll_step_batch): minus each term's logprob (N,);
    nothing is clipped or weighted."""
    ones = torch.ones_like(logp.detach())
    return losses.PolicyLoss(-logp, torch.zeros_like(ones), ones, ones, torch.zeros_like(ones))


# the float64 sums a micro-step returns: the aggregation-weighted loss parts, then the token sums
# of the mismatch (learner/mismatch.py) and of the policy's entropy, which the step divides by its
# number of terms
SUMS = ("loss", "pg", "kl", "clip", "ratio", "is_weight", "is_corrected", "mismatch_kl", "mismatch_abs", "out_of_clip",
        "entropy")


def _micro_step(learner: Learner, batch: StepBatch, i: int, scale: float, objective: Objective,
                rollout_log_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of micro-batch i, its loss weighted by `scale` (0: a filler pass).
    Returns its SUMS (float64) and its largest |delta logprob| (0-d float64)."""
    cfg, device = learner.cfg, learner.device
    terms = batch.terms[i]
    inputs = batch_tensors(batch.micro_batches[i], terms, device)
    with learner.autocast():  # the step's first forward: pi_old, before any update
        logp = learner.policy(**inputs, chunk_tokens=cfg.logprob_chunk_tokens)  # (N,)
    behaviour = torch.from_numpy(terms.behaviour_logp).to(device)
    weight = torch.from_numpy(batch.weights[i]).to(device, torch.float32) * scale
    if objective == "nll":
        policy = nll_objective(logp)
    else:
        advantage = torch.from_numpy(batch.advantages[i]).to(device)
        policy = grpo_objective(logp, behaviour, advantage, cfg, rollout_log_ratio=rollout_log_ratio)
    kl = torch.zeros_like(policy.loss)
    if learner.ref is not None and objective == "grpo":
        with torch.no_grad(), learner.autocast():
            ref_logp = learner.ref(**inputs, chunk_tokens=cfg.logprob_chunk_tokens)
        kl = losses.kl_k3(logp, ref_logp)
    loss = ((policy.loss + cfg.kl_coef * kl) * weight).sum()
    (loss * learner.world).backward()  # FSDP2 averages over ranks; weights already sum to 1
    with torch.no_grad():
        parts = [loss, (policy.loss * weight).sum(), (kl * weight).sum(), *((x * weight).sum() for x in policy[1:])]
        sums = torch.stack([p.detach().double().cpu() for p in parts])
        gap, top = torch.zeros(3, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        if objective == "grpo" and scale and len(logp):  # the nll objective's behaviour logprobs are 0s
            k3, delta, outside = losses.mismatch_terms(logp, behaviour, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
            gap = torch.stack([k3.sum(), delta.sum(), outside.sum()]).cpu()
            top = delta.max().cpu()
        entropy = learner.policy.entropy
        ent = (entropy.double().sum() if scale and entropy is not None else torch.zeros((), dtype=torch.float64)).cpu()
        return torch.cat([sums, gap, ent[None]]), top


@torch.no_grad()
def _rollout_log_ratios(learner: Learner, batch: StepBatch, mine: list[int], n_local: int) -> torch.Tensor:
    """The mean log(pi_old / pi_behaviour) of each rollout over the whole step (float64, indexed
    by keys_rollout), for the rollout-level mask: it needs every token of a rollout before the
    first backward, so it costs one extra forward of the step."""
    size = max((int(k.max()) + 1 for k in batch.keys_rollout if len(k)), default=0)
    sums, counts = torch.zeros(size, dtype=torch.float64), torch.zeros(size, dtype=torch.float64)
    for j in range(n_local):
        i = mine[j] if j < len(mine) else 0  # a filler pass still runs: FSDP2's gathers are collective
        terms = batch.terms[i]
        with learner.autocast():
            logp = learner.policy(**batch_tensors(batch.micro_batches[i], terms, learner.device),
                                  chunk_tokens=learner.cfg.logprob_chunk_tokens)
        if j < len(mine):
            keys = torch.from_numpy(batch.keys_rollout[i])
            sums.index_add_(0, keys, logp.double().cpu() - torch.from_numpy(terms.behaviour_logp).double())
            counts.index_add_(0, keys, torch.ones(len(keys), dtype=torch.float64))
    sums, counts = _all_reduce(learner, sums), _all_reduce(learner, counts)
    return sums / counts.clamp(min=1)


def _all_reduce(learner: Learner, t: torch.Tensor, op: Any = None) -> torch.Tensor:
    """Sum (or `op`) a small CPU tensor over the ranks, through the learner's device (NCCL
    reduces only CUDA tensors)."""
    if learner.world == 1:
        return t
    on_device = t.to(learner.device)
    dist.all_reduce(on_device, op=op or dist.ReduceOp.SUM)
    return on_device.cpu()


# --------------------------------------------------------------------------------------- step


def _accumulate(learner: Learner, batch: StepBatch, objective: Objective,
                control: StepControl) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward every micro-batch this rank owns (i::world); the SUMS and the largest
    |delta logprob| over the whole step, reduced over the ranks. `control` sees each micro-batch
    start and end, and stops the step between any two (StepInterrupted)."""
    cfg = learner.cfg
    n = len(batch.micro_batches)
    mine = list(range(learner.rank, n, learner.world))
    n_local = -(-n // learner.world) if n else 0
    tokens = [len(batch.micro_batches[i].tokens) for i in mine]
    control.begin(tokens)
    by_rollout = None
    if objective == "grpo" and cfg.is_correction == "mask" and cfg.is_mask_level == "rollout":
        by_rollout = _rollout_log_ratios(learner, batch, mine, n_local)
    sums, top = torch.zeros(len(SUMS), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for j in range(n_local):
        i, scale = (mine[j], 1.0) if j < len(mine) else (0, 0.0)  # zero-weight filler pass
        if hasattr(learner.policy, "set_requires_gradient_sync"):
            learner.policy.set_requires_gradient_sync(j == n_local - 1)
        rollout_log_ratio = None
        if by_rollout is not None:
            rollout_log_ratio = by_rollout[torch.from_numpy(batch.keys_rollout[i])].to(learner.device)
        control.check()
        control.micro_batch = j + 1
        part, part_top = _micro_step(learner, batch, i, scale, objective, rollout_log_ratio)
        sums, top = sums + part, torch.maximum(top, part_top)
        control.tokens_done += tokens[j] if j < len(tokens) else 0
    return _all_reduce(learner, sums), _all_reduce(learner, top, dist.ReduceOp.MAX)


def _train_step(learner: Learner, batch: StepBatch, objective: Objective, gate: Gate | None = None,
                control: StepControl | None = None) -> StepMetrics:
    """Forward/backward of the whole step, the mismatch gate when given one, then one clipped
    AdamW step. A gate that fails raises MismatchError before the update (gradients dropped);
    so does a stop request through `control` (StepInterrupted), on a single process."""
    if objective not in ("grpo", "nll"):
        raise ValueError(f"objective must be grpo or nll, got {objective!r}")
    started = time.perf_counter()
    learner.policy.train()
    n = len(batch.micro_batches)
    control = control or StepControl()
    control.interruptible = learner.world == 1  # one rank cannot leave a collective call alone
    learner.policy.control = control
    try:
        sums, top = _accumulate(learner, batch, objective, control)
    except StepInterrupted:
        learner.optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        learner.policy.control = None
    parts = dict(zip(SUMS, sums.tolist()))
    n_terms = batch.n_terms
    figures = mismatch.Figures(kl=parts["mismatch_kl"] / max(n_terms, 1), abs_mean=parts["mismatch_abs"] / max(n_terms, 1),
                               abs_max=float(top), out_of_clip=parts["out_of_clip"] / max(n_terms, 1), n_tokens=n_terms)
    if gate is not None and objective == "grpo":
        try:
            mismatch.check(figures, gate)
        except MismatchError:
            learner.optimizer.zero_grad(set_to_none=True)
            raise
    grad_norm = _clip_and_step(learner.policy, learner.optimizer, learner.cfg.grad_clip) if n else 0.0
    learner.step_count += 1
    learner.version += 1
    return StepMetrics(
        step=learner.step_count, version=learner.version, loss=parts["loss"], pg_loss=parts["pg"], kl=parts["kl"],
        clip_frac=parts["clip"], ratio_mean=parts["ratio"], grad_norm=grad_norm, reward_mean=batch.reward_mean,
        n_rollouts=batch.n_rollouts, n_terms=n_terms, n_tokens=batch.n_tokens, n_micro_batches=n,
        time_s=time.perf_counter() - started, mismatch_kl=figures.kl, mismatch_abs_mean=figures.abs_mean,
        mismatch_abs_max=figures.abs_max, mismatch_out_of_clip=figures.out_of_clip,
        is_weight_mean=parts["is_weight"], is_corrected=parts["is_corrected"],
        entropy=parts["entropy"] / max(n_terms, 1),
    )


def _clip_and_step(policy: PackedLM, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


# ------------------------------------------------------------------------------------ metrics


class StepMetrics(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    version: int  # policy version after this step
    loss: float  # the aggregated objective (pg + kl_coef * kl)
    pg_loss: float
    kl: float  # aggregated k3 estimate of KL to the starting policy (0 unless kl_coef > 0 or track_kl)
    clip_frac: float  # weighted share of terms whose loss was clipped or capped
    ratio_mean: float  # weighted mean of the PPO ratio the clip saw (pi_old-based under tis/mask: 1)
    grad_norm: float
    reward_mean: float  # over scored (non-infra) rollouts given to the step
    n_rollouts: int  # rollouts trained on
    n_terms: int  # loss terms (sampled tokens + extra samples)
    n_tokens: int  # tokens forwarded
    n_micro_batches: int
    time_s: float
    # the engine/learner mismatch at the step's first forward, before the update, per sampled token
    # (learner/mismatch.py); after the first step it also holds staleness (older policy versions)
    mismatch_kl: float = 0.0  # k3 estimate of KL(behaviour || learner), token mean
    mismatch_abs_mean: float = 0.0  # mean |log pi_learner - log pi_behaviour|
    mismatch_abs_max: float = 0.0  # max of the same
    mismatch_out_of_clip: float = 0.0  # share of tokens whose pi_learner / pi_behaviour is outside the clip band
    is_weight_mean: float = 1.0  # weighted mean importance weight on the policy term (learner.is_correction)
    is_corrected: float = 0.0  # weighted share of terms whose weight tis truncated or mask set to 0
    entropy: float = 0.0  # the policy's mean entropy (nats, at the sampling temperature) where it sampled, before the update


# ------------------------------------------------------------------------ weights, checkpoint


def _weight_stream(policy: PackedLM) -> WeightStream:
    """The weights to serve, each gathered only when read (collective under FSDP2: every rank
    must read the whole stream, in order), tied ones once: a parameter reached under a second
    name (lm_head.weight tied to embed_tokens.weight) is left out, as the model's own
    checkpoint has it. Decided from the module tree, so every rank leaves out the same."""
    params = dict(policy.lm.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    tied = {name for name, p in params.items() if first.setdefault(id(p), name) != name}
    kept = [(name, t) for name, t in policy.lm.state_dict().items() if name not in tied]

    def gathered() -> Iterator[torch.Tensor]:
        for _, t in kept:
            yield (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

    return WeightStream([(name, tuple(t.shape)) for name, t in kept], gathered())


# -------------------------------------------------------------------------------- the learner


class Learner:
    """Owns the trainable model, its optimizer, the step counter and the policy version; its
    methods run the sections above."""

    def __init__(
        self,
        cfg: LearnerConfig,
        model: torch.nn.Module,
        *,
        layout: str = "tree",
        max_tokens: int = 8192,
        merge_impl: merge.Impl = "rust",
        temperature: float = 1.0,
        weights_from: torch.nn.Module | None = None,
    ) -> None:
        """`model` may have its parameters on the meta device (model.empty_model) when several
        ranks train it: it is sharded first, then every rank receives only its shard of the
        weights from rank 0's `weights_from` (the loaded model; None on the other ranks)."""
        self.cfg = cfg
        self.layout = layout
        self.max_tokens = max_tokens
        self.merge_impl = merge_impl
        self.device = torch.device(cfg.device)
        self.rank, self.world = _world()
        if self.device.type == "cpu":  # freed activations leave the heap (4.7 -> 3.8 GiB at 4k tokens)
            fix_mmap_threshold(cfg.malloc_mmap_threshold_kib)
        on_meta = _prepare_model(model, cfg, layout=layout, device=self.device, world=self.world,
                                 merge_impl=merge_impl)
        self.ref = None
        if cfg.kl_coef > 0 or cfg.track_kl:  # a frozen copy of the starting policy
            self.ref = PackedLM(copy.deepcopy(model).eval().requires_grad_(False), temperature=temperature)
        self.policy = PackedLM(model, temperature=temperature)  # the run's sampling temperature
        if self.world > 1:
            _shard(self.policy, cfg, self.device, self.world)
        if on_meta:
            _receive_weights(self.policy, self.ref, weights_from, device=self.device, rank=self.rank)
        self.optimizer = _optimizer(self.policy, cfg, self.device)
        self.step_count = 0
        self.version = 0

    @classmethod
    def from_config(cls, cfg: Config, *, merge_impl: merge.Impl = "rust") -> Learner:
        """Under torchrun only rank 0 reads the weights (into CPU memory); every rank builds the
        model on the meta device and receives its shard, so no GPU ever holds the whole fp32
        model and the host holds one copy, not one per rank."""
        from polar_fast.model import empty_model, load_model

        rank, world = _world()
        options: dict[str, Any] = dict(layout=cfg.merge.layout, max_tokens=cfg.merge.max_tokens,
                                       merge_impl=merge_impl, temperature=cfg.sampling.temperature)
        if world == 1:
            return cls(cfg.learner, load_model(cfg.model.path, dtype="float32", device="cpu"), **options)
        full = load_model(cfg.model.path, dtype="float32", device="cpu") if rank == 0 else None
        return cls(cfg.learner, empty_model(cfg.model.path, dtype="float32"), weights_from=full, **options)

    def prepare(self, groups: Sequence[GroupRecord]) -> StepBatch:
        return build_step_batch(groups, self.cfg, layout=self.layout, max_tokens=self.max_tokens,
                                merge_impl=self.merge_impl)

    def step(self, groups: Sequence[GroupRecord], *, gate: Gate | None = None,
             control: StepControl | None = None) -> StepMetrics:
        """One GRPO step on these finished groups; with a `gate`, MismatchError instead of the
        update when the engine and the learner disagree too much (a run's first step). `control`
        (learner/step_control.py) shows its progress and can stop it before the update."""
        return _train_step(self, self.prepare(groups), "grpo", gate, control)

    def train_step(self, batch: StepBatch, *, objective: Objective = "grpo", gate: Gate | None = None,
                   control: StepControl | None = None) -> StepMetrics:
        """One step on a prepared batch; objective "nll": supervised fine-tuning (nll_step_batch)."""
        return _train_step(self, batch, objective, gate, control)

    def autocast(self):
        enabled = self.cfg.dtype == "bfloat16" and self.world == 1
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def nll(self, batch: StepBatch) -> float:
        """The token-mean negative log-likelihood of an nll_step_batch, without training."""
        total = 0.0
        self.policy.eval()
        with torch.no_grad():
            for mb, terms, weight in zip(batch.micro_batches, batch.terms, batch.weights):
                logp = self.policy(**batch_tensors(mb, terms, self.device), chunk_tokens=self.cfg.logprob_chunk_tokens)
                total += float(-(logp.double().cpu() * torch.from_numpy(weight)).sum())
        return total

    @torch.no_grad()
    def logprobs(self, calls: Sequence[CallRecord]) -> list[np.ndarray]:
        """The policy's logprob of each call's completion tokens (float32 (n,) per call), as a step
        computes them: what the first step's importance ratio compares the behaviour logprobs to."""
        self.policy.eval()
        out = []
        for mb in percall_batches(calls):
            inputs = batch_tensors(mb, loss_terms(mb), self.device)
            with self.autocast():
                logp = self.policy(**inputs, chunk_tokens=self.cfg.logprob_chunk_tokens)
            out.append(logp.float().cpu().numpy())
        return out

    def weight_stream(self) -> WeightStream:
        return _weight_stream(self.policy)

    async def sync_weights(self, sync: Any) -> None:
        """Push the current weights (rank 0) and stamp them with this learner's version."""
        stream = self.weight_stream()
        if self.rank == 0:
            await sync.push(stream, version=self.version)
        else:
            for _ in stream:  # the gathers are collective
                pass

    def save(self, directory: str) -> str:
        return str(save_checkpoint(directory, model=self.policy, optimizer=self.optimizer,
                                   step=self.step_count, version=self.version))

    def resume(self, directory: str) -> bool:
        """Load the newest checkpoint under `directory`; False when there is none."""
        path = latest_checkpoint(directory)
        if path is None:
            return False
        self.step_count, self.version = load_checkpoint(path, model=self.policy, optimizer=self.optimizer)
        return True
