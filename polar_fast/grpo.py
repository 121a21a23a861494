"""The GRPO learner: captured calls + rewards in, one optimizer step on packed trie batches out.

Reads top to bottom: config -> setup (model, FSDP2, optimizer) -> packed batches (advantages,
merge, pack, loss terms, aggregation weights) -> loss -> step -> metrics -> weights/checkpoint.

The variant, and where it deviates from paper GRPO (DeepSeekMath):
- One advantage per rollout (a whole harness run, many model calls), from the group's rewards:
  mean/std (default), mean only (Dr. GRPO) or leave-one-out (RLOO); spread over every token the
  rollout sampled. Zero-variance groups and infra_error rollouts are left out before merging,
  so they cost no compute.
- Training data is the prefix-trie merge of the group's calls, not one sequence per call:
  `tree` computes each shared prefix once (ancestor-rule attention, depth as position id),
  `paths` computes each leaf path once. Extra samples (the same token sampled by two rollouts
  after the same prefix) each add their own loss term at the shared position.
- Token-level PPO clip with clip-higher bounds, ratio against the recorded behaviour logprob
  (not a learner recomputation: one optimizer step per batch makes "old" == current, so the
  behaviour logprob is the only meaningful reference and the ratio also absorbs engine/learner
  numeric mismatch and staleness), plus a dual-clip cap on the importance weight. KL to a
  frozen reference is off by default (k3 estimator when on).
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
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from polar_fast import merge
from polar_fast.config import LAYOUTS as MERGE_LAYOUTS
from polar_fast.config import Config, LearnerConfig
from polar_fast.learner import losses, packed_attention, packed_check
from polar_fast.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from polar_fast.learner.packed_forward import PackedLM, Terms, batch_tensors, loss_terms
from polar_fast.learner.weight_sync import WeightStream
from polar_fast.records import CallRecord, Outcome
from polar_fast.rollouts.groups import GroupRecord

LAYOUTS = (*MERGE_LAYOUTS, "percall")  # the merge's layouts, and one sequence per call (the baseline)

# ------------------------------------------------------------------------------ packed batches


@dataclass(frozen=True, eq=False)
class StepBatch:
    """Everything one optimizer step trains on. Lists are per micro-batch; arrays per term."""

    micro_batches: list[Any]
    terms: list[Terms]
    advantages: list[np.ndarray]  # float32 (N,)
    weights: list[np.ndarray]  # float64 (N,): aggregation weights, summing to 1 over the step
    keys_rollout: list[np.ndarray]  # int64 (N,): global rollout index (per-rollout key)
    n_rollouts: int
    reward_mean: float

    @property
    def n_terms(self) -> int:
        return sum(len(t.position) for t in self.terms)

    @property
    def n_tokens(self) -> int:
        return sum(len(mb.tokens) for mb in self.micro_batches)


def percall_batches(calls: Sequence[CallRecord]) -> list[Any]:
    """The per-call baseline: each call its own sequence and micro-batch, no merging."""
    from polar_fast.merge.arrays import MicroBatch

    out = []
    for c in calls:
        n_p, n = len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)
        mask = np.zeros(n, np.uint8)
        mask[n_p:] = 1
        logprobs = np.zeros(n, np.float32)
        logprobs[n_p:] = c.completion_logprobs
        out.append(MicroBatch(
            tokens=np.array(c.prompt_ids + c.completion_ids, np.int32),
            positions=np.arange(n, dtype=np.int32),
            parent=np.arange(-1, n - 1, dtype=np.int32),
            size=np.arange(n, 0, -1, dtype=np.int32),
            loss_mask=mask,
            logprobs=logprobs,
            versions=np.where(mask == 1, c.policy_version, -1).astype(np.int32),
            rollout=np.zeros(n, np.int32),
            node=np.arange(n, dtype=np.int32),
            offsets=np.array([0, n], np.int32),
            extra_index=np.zeros(0, np.int32), extra_rollout=np.zeros(0, np.int32),
            extra_logprob=np.zeros(0, np.float32), extra_version=np.zeros(0, np.int32),
        ))
    return out


def _group_batches(
    calls: list[CallRecord], layout: str, max_tokens: int, merge_impl: merge.Impl
) -> list[tuple[Any, list[str]]]:
    """(micro-batch, rollout_ids its `rollout` indexes into) for one group's calls."""
    if layout == "percall":
        return [(mb, [c.rollout_id]) for mb, c in zip(percall_batches(calls), calls)]
    merged = merge.merge(calls, layout=layout, impl=merge_impl)
    return [(mb, merged.rollout_ids) for mb in merge.pack(merged, max_tokens=max_tokens, impl=merge_impl)]


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
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    per_group = [(g, losses.rollout_advantages(g.records, cfg.advantage)) for g in groups]
    advantages = {rid: a for _, adv in per_group for rid, a in adv.items()}
    scored = [r.reward for g in groups for r in g.records if r.outcome != Outcome.INFRA_ERROR and r.reward is not None]
    rollout_index = {rid: i for i, rid in enumerate(sorted(advantages))}
    mbs, terms, advs, keys_r, keys_s = [], [], [], [], []
    n_seq = 0
    for group, adv in per_group:
        group_calls = [c for r in group.rollouts if r.record.rollout_id in adv for c in r.calls]
        if not group_calls:
            continue
        for mb, rollout_ids in _group_batches(group_calls, layout, max_tokens, merge_impl):
            t = loss_terms(mb)
            rids = [rollout_ids[i] for i in t.rollout]
            mbs.append(mb)
            terms.append(t)
            advs.append(np.array([advantages[r] for r in rids], np.float32))
            keys_r.append(np.array([rollout_index[r] for r in rids], np.int64))
            keys_s.append(t.sequence + n_seq)
            n_seq += len(mb.offsets) - 1
    weights = _split_weights(cfg.aggregation, keys_r, keys_s)
    return StepBatch(mbs, terms, advs, weights, keys_r, n_rollouts=len({r for k in keys_r for r in k}),
                     reward_mean=float(np.mean(scored)) if scored else math.nan)


def trains_on(group: GroupRecord, cfg: LearnerConfig) -> bool:
    """Whether a step would train on any of this group's rollouts: the rule build_step_batch
    applies (scored rollouts, at least two, rewards not all equal)."""
    return bool(losses.rollout_advantages(group.records, cfg.advantage))


def nll_step_batch(
    rows: Sequence[tuple[Sequence[int], Sequence[int]]], *, layout: str = "tree", max_tokens: int = 8192,
    merge_impl: merge.Impl = "rust",
) -> StepBatch:
    """Supervised fine-tuning on token rows (input_ids, loss_mask), as `export` writes them: every
    masked token one term, all terms weighted the same (token mean). Each row's masked runs become
    the calls they were sampled as (prompt = all before the run), and the rows are merged like a
    GRPO group, so the system prompt they share is forwarded once per micro-batch, not once per
    row. Train it with `Learner.train_step(batch, objective="nll")`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    calls = []
    for r, (ids, mask) in enumerate(rows):
        if len(mask) != len(ids):
            raise ValueError(f"a token row has {len(ids)} input_ids but {len(mask)} loss_mask entries")
        ids, mask = list(ids), [int(m) for m in mask]
        for j, (start, end) in enumerate(_masked_runs(mask)):
            calls.append(CallRecord(
                session_id=f"row{r}", rollout_id=f"row{r:08d}", group_id="sft", call_index=j,
                prompt_ids=ids[:start], completion_ids=ids[start:end], completion_logprobs=[0.0] * (end - start),
                policy_version=0, finish_reason="stop", dialect="chat"))
    mbs = [mb for mb, _ in _group_batches(calls, layout, max_tokens, merge_impl)] if calls else []
    terms = [loss_terms(mb) for mb in mbs]
    total = sum(len(t.position) for t in terms)
    weights = [np.full(len(t.position), 1.0 / total if total else 0.0) for t in terms]
    return StepBatch(mbs, terms, [np.ones(len(t.position), np.float32) for t in terms], weights,
                     [t.rollout.astype(np.int64) for t in terms], n_rollouts=len(rows), reward_mean=math.nan)


def _masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s (a run at position 0 has no prompt to condition on: skipped)."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            if start > 0:
                runs.append((start, i))
            start = None
    return runs


def _split_weights(mode: str, keys_r: list[np.ndarray], keys_s: list[np.ndarray]) -> list[np.ndarray]:
    """Aggregation weights over the whole step, cut back into per-micro-batch pieces."""
    if not keys_r:
        return []
    keys = losses.aggregation_keys(mode, torch.from_numpy(np.concatenate(keys_r)),
                                   torch.from_numpy(np.concatenate(keys_s)))
    flat = losses.mean_of_means_weights(keys).numpy()
    return np.split(flat, np.cumsum([len(k) for k in keys_r])[:-1])


# ------------------------------------------------------------------------------------- metrics


class StepMetrics(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    version: int  # policy version after this step
    loss: float  # the aggregated objective (pg + kl_coef * kl)
    pg_loss: float
    kl: float  # aggregated k3 estimate (0 when kl_coef == 0)
    clip_frac: float  # weighted share of terms whose loss was clipped or capped
    ratio_mean: float  # weighted mean importance ratio
    grad_norm: float
    reward_mean: float  # over scored (non-infra) rollouts given to the step
    n_rollouts: int  # rollouts trained on
    n_terms: int  # loss terms (sampled tokens + extra samples)
    n_tokens: int  # tokens forwarded
    n_micro_batches: int
    time_s: float


# --------------------------------------------------------------------------------------- setup


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _attention_impl(cfg: LearnerConfig, device: torch.device) -> str:
    kind = cfg.attention
    if kind == "auto":
        kind = "flex_attention" if device.type == "cuda" else "sdpa"
    return packed_attention.NAME if kind == "sdpa" else kind  # SDPA kernels, per block, no (T, T) mask


class Learner:
    """Owns the trainable model, its optimizer, the step counter and the policy version."""

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
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and self.world == 1:
            raise ValueError("a model on the meta device needs torch.distributed ranks to shard it over")
        if not on_meta:
            model.to(self.device)
        attention = _attention_impl(cfg, self.device)
        model.set_attn_implementation(attention)
        if cfg.check_packed and layout != "percall":  # before any step: a layer that leaks stops the run
            packed_check.check(model, layout, attention=attention, device=self.device, merge_impl=merge_impl)
        if cfg.gradient_checkpointing:  # transformers 5 renamed it; older versions have only the first
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref = None
        if cfg.kl_coef > 0:  # a frozen copy of the starting policy
            self.ref = PackedLM(copy.deepcopy(model).eval().requires_grad_(False), temperature=temperature)
        self.policy = PackedLM(model, temperature=temperature)  # the run's sampling temperature
        if self.world > 1:
            self._shard()
        if on_meta:
            self._receive_weights(weights_from)
        self.optimizer = torch.optim.AdamW(  # fused: one kernel for all parameters (CPU and CUDA)
            self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
            fused=self.device.type in ("cpu", "cuda"),
        )
        self.step_count = 0
        self.version = 0

    @classmethod
    def from_config(cls, cfg: Config, *, merge_impl: merge.Impl = "rust") -> Learner:
        """Under torchrun only rank 0 reads the weights (into CPU memory); every rank builds the
        model on the meta device and receives its shard, so no GPU ever holds the whole fp32
        model and the host holds one copy, not one per rank."""
        from polar_fast.model import empty_model, load_model

        rank, world = _world()
        options = dict(layout=cfg.merge.layout, max_tokens=cfg.merge.max_tokens, merge_impl=merge_impl,
                       temperature=cfg.sampling.temperature)
        if world == 1:
            return cls(cfg.learner, load_model(cfg.model.path, dtype="float32", device="cpu"), **options)
        full = load_model(cfg.model.path, dtype="float32", device="cpu") if rank == 0 else None
        return cls(cfg.learner, empty_model(cfg.model.path, dtype="float32"), weights_from=full, **options)

    def _receive_weights(self, full: torch.nn.Module | None) -> None:
        """Materialise the sharded meta parameters on this rank's device and fill them from rank 0:
        each rank keeps only its shard (set_model_state_dict broadcasts tensor by tensor). The
        buffers no checkpoint holds (rotary frequencies) were built for real; they come along."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if (full is None) != (self.rank != 0):
            raise ValueError("rank 0, and only rank 0, gives the weights")
        lm = self.policy.lm
        buffers = {name: b.detach().clone() for name, b in lm.named_buffers()}
        self.policy.to_empty(device=self.device)
        state = full.state_dict() if full is not None else {}
        set_model_state_dict(lm, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        persistent = set(lm.state_dict())
        with torch.no_grad():
            for name, b in lm.named_buffers():
                if name not in persistent:
                    b.copy_(buffers[name])
            if self.ref is not None:  # the frozen reference is whole on every rank: broadcast it
                self.ref.to_empty(device=self.device)
                source = full.state_dict() if full is not None else {}  # set_model_state_dict consumed `state`
                for name, t in self.ref.lm.state_dict().items():
                    if self.rank == 0:
                        t.copy_(source[name])
                    dist.broadcast(t, src=0)
                for name, b in self.ref.lm.named_buffers():
                    if name in buffers and name not in persistent:
                        b.copy_(buffers[name])

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        mp = MixedPrecisionPolicy()
        if self.cfg.dtype == "bfloat16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in self.policy.lm.get_decoder().layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self.policy, mesh=mesh, mp_policy=mp)

    # ------------------------------------------------------------------------------- the step

    def prepare(self, groups: Sequence[GroupRecord]) -> StepBatch:
        return build_step_batch(groups, self.cfg, layout=self.layout, max_tokens=self.max_tokens,
                                merge_impl=self.merge_impl)

    def step(self, groups: Sequence[GroupRecord]) -> StepMetrics:
        return self.train_step(self.prepare(groups))

    def train_step(self, batch: StepBatch, *, objective: str = "grpo") -> StepMetrics:
        """Forward/backward every micro-batch this rank owns, then one clipped AdamW step.
        objective "nll": supervised fine-tuning (nll_step_batch): minus the logprob per term."""
        if objective not in ("grpo", "nll"):
            raise ValueError(f"objective must be grpo or nll, got {objective!r}")
        started = time.perf_counter()
        self.policy.train()
        n = len(batch.micro_batches)
        mine = list(range(self.rank, n, self.world))
        n_local = -(-n // self.world) if n else 0
        sums = torch.zeros(5, dtype=torch.float64)  # loss, pg, kl, clip, ratio (weighted)
        for j in range(n_local):
            i, scale = (mine[j], 1.0) if j < len(mine) else (0, 0.0)  # zero-weight filler pass
            if hasattr(self.policy, "set_requires_gradient_sync"):
                self.policy.set_requires_gradient_sync(j == n_local - 1)
            sums += self._micro_step(batch, i, scale, objective)
        if self.world > 1:
            dist.all_reduce(sums)
        grad_norm = self._clip_and_step() if n else 0.0
        self.step_count += 1
        self.version += 1
        loss, pg, kl, clip, ratio = sums.tolist()
        return StepMetrics(
            step=self.step_count, version=self.version, loss=loss, pg_loss=pg, kl=kl,
            clip_frac=clip, ratio_mean=ratio, grad_norm=grad_norm, reward_mean=batch.reward_mean,
            n_rollouts=batch.n_rollouts, n_terms=batch.n_terms, n_tokens=batch.n_tokens,
            n_micro_batches=n, time_s=time.perf_counter() - started,
        )

    def nll(self, batch: StepBatch) -> float:
        """The token-mean negative log-likelihood of an nll_step_batch, without training."""
        total = 0.0
        self.policy.eval()
        with torch.no_grad():
            for mb, terms, weight in zip(batch.micro_batches, batch.terms, batch.weights):
                logp = self.policy(**batch_tensors(mb, terms, self.device), chunk_tokens=self.cfg.logprob_chunk_tokens)
                total += float(-(logp.double().cpu() * torch.from_numpy(weight)).sum())
        return total

    def _micro_step(self, batch: StepBatch, i: int, scale: float, objective: str = "grpo") -> torch.Tensor:
        terms = batch.terms[i]
        inputs = batch_tensors(batch.micro_batches[i], terms, self.device)
        with self._autocast():
            logp = self.policy(**inputs, chunk_tokens=self.cfg.logprob_chunk_tokens)  # (N,)
        behaviour = torch.from_numpy(terms.behaviour_logp).to(self.device)
        adv = torch.from_numpy(batch.advantages[i]).to(self.device)
        weight = torch.from_numpy(batch.weights[i]).to(self.device, torch.float32) * scale
        pg, clipped = losses.ppo_token_loss(
            logp, behaviour, adv, clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high,
            max_importance_weight=self.cfg.max_importance_weight,
        )
        if objective == "nll":
            pg, clipped = -logp, torch.zeros_like(logp)
        kl = torch.zeros_like(pg)
        if self.ref is not None and objective == "grpo":
            with torch.no_grad(), self._autocast():
                ref_logp = self.ref(**inputs, chunk_tokens=self.cfg.logprob_chunk_tokens)
            kl = losses.kl_k3(logp, ref_logp)
        term_loss = pg + self.cfg.kl_coef * kl
        loss = (term_loss * weight).sum()
        (loss * self.world).backward()  # FSDP2 averages over ranks; weights already sum to 1
        with torch.no_grad():
            ratio = torch.exp(logp - behaviour)
            parts = [loss, (pg * weight).sum(), (kl * weight).sum(), (clipped * weight).sum(),
                     (ratio * weight).sum()]
            return torch.stack([p.detach().double().cpu() for p in parts])

    def _autocast(self):
        enabled = self.cfg.dtype == "bfloat16" and self.world == 1
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _clip_and_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.grad_clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @torch.no_grad()
    def logprobs(self, calls: Sequence[CallRecord]) -> list[np.ndarray]:
        """The policy's logprob of each call's completion tokens (float32 (n,) per call), as a step
        computes them: what the first step's importance ratio compares the behaviour logprobs to."""
        self.policy.eval()
        out = []
        for mb in percall_batches(calls):
            inputs = batch_tensors(mb, loss_terms(mb), self.device)
            with self._autocast():
                logp = self.policy(**inputs, chunk_tokens=self.cfg.logprob_chunk_tokens)
            out.append(logp.float().cpu().numpy())
        return out

    # ---------------------------------------------------------------------- weights, checkpoint

    def weight_stream(self) -> WeightStream:
        """The weights to serve, each gathered only when read (collective under FSDP2: every rank
        must read the whole stream, in order), tied ones once: a parameter reached under a second
        name (lm_head.weight tied to embed_tokens.weight) is left out, as the model's own
        checkpoint has it. Decided from the module tree, so every rank leaves out the same."""
        params = dict(self.policy.lm.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        tied = {name for name, p in params.items() if first.setdefault(id(p), name) != name}
        kept = [(name, t) for name, t in self.policy.lm.state_dict().items() if name not in tied]

        def gathered() -> Iterator[torch.Tensor]:
            for _, t in kept:
                yield (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

        return WeightStream([(name, tuple(t.shape)) for name, t in kept], gathered())

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
