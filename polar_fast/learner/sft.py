"""`python -m polar_fast sft`: supervised fine-tuning on the token rows `export` writes.

    report = run_sft(cfg, "sft/", Learner.from_config, out_dir="runs/default/sft")   # -> an HF model directory

This closes the loop of test-verified traces -> SFT data -> a better starting policy -> RL. The
rows are `tokens.jsonl` (input_ids + loss_mask: 1 on every token the policy sampled), trained
with the same packed learner as GRPO (grpo.Learner, which the caller passes in as its builder;
batches.nll_step_batch, objective "nll"): token-mean
negative log-likelihood over the masked tokens, AdamW, the run's grad clip. The token-mean NLL
over all rows is measured before and after, so the report says whether the data was learned.
The result is a plain HF directory (weights + config + tokenizer): `model.path`, `eval
--checkpoint` and vLLM all load it as is.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import msgspec

from polar_fast.config import Config
from polar_fast.errors import PolarError
from polar_fast.learner.batches import StepBatch, nll_step_batch
from polar_fast.learner.host_memory import release_free_memory


class SftError(PolarError):
    """The SFT data cannot be used (missing, malformed, no trainable token)."""


class SftLearner(Protocol):
    """What fine-tuning uses of the learner (grpo.Learner)."""

    policy: Any  # learner/packed_forward.PackedLM: `.lm` is the HF model saved at the end

    def nll(self, batch: StepBatch) -> float: ...

    def train_step(self, batch: StepBatch, *, objective: Any = ...) -> Any: ...


class SftReport(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    tokens: int  # tokens forwarded per epoch
    trained_tokens: int  # loss-mask tokens per epoch
    steps: int
    nll_before: float
    nll_after: float
    duration_s: float
    model_dir: str


def read_rows(data: str | Path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every row of `data`/tokens.jsonl (or a .jsonl file itself)."""
    path = Path(data)
    if path.is_dir():
        path = path / "tokens.jsonl"
    if not path.is_file():
        raise SftError(f"no SFT token rows at {path}: write them with `python -m polar_fast export`")
    rows = []
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
                ids, mask = [int(x) for x in row["input_ids"]], [int(x) for x in row["loss_mask"]]
            except (ValueError, KeyError, TypeError) as e:
                raise SftError(f"{path}: row {number}: not a token row with input_ids and loss_mask ({e})") from None
            if len(ids) != len(mask):
                raise SftError(f"{path}: row {number}: {len(ids)} input_ids but {len(mask)} loss_mask entries")
            if any(mask):
                rows.append((ids, mask))
    if not rows:
        raise SftError(f"{path}: no row has a trainable (loss_mask = 1) token")
    return rows


def run_sft(cfg: Config, data: str | Path, build_learner: Callable[[Config], SftLearner], *,
            out_dir: str | Path, epochs: int | None = None, lr: float | None = None,
            emit: Callable[[str, dict], None] | None = None, measure: bool = True) -> SftReport:
    """Fine-tune cfg.model on the rows of `data`; writes the model to `out_dir`. `build_learner`
    makes the learner from the config with sft's learning rate (grpo.Learner.from_config).

    measure=False skips the two extra passes over all rows (a forward each, ~1/3 of an epoch):
    nll_before / nll_after are then the first and last epoch's mean step losses, each step's
    measured before its update."""
    from polar_fast.model import load_tokenizer

    emit = emit or (lambda kind, data: None)
    sc = cfg.sft
    epochs = sc.epochs if epochs is None else epochs
    if epochs < 1 or sc.rows_per_step < 1 or sc.micro_batch_tokens < 0:
        raise SftError(f"sft needs epochs >= 1, rows_per_step >= 1 and micro_batch_tokens >= 0 "
                       f"(got {epochs}, {sc.rows_per_step}, {sc.micro_batch_tokens})")
    rows = read_rows(data)
    started = time.perf_counter()
    learner_cfg = msgspec.structs.replace(cfg.learner, lr=sc.lr if lr is None else lr, kl_coef=0.0)
    packing = {"layout": cfg.merge.layout, "max_tokens": cfg.merge.max_tokens}
    if sc.micro_batch_tokens:
        # A micro-batch's packed attention grows with the square of its tokens: on 2 cores a
        # checkpointed step of two warm-start demonstrations (2,600 tokens) took 19.4 s as one
        # micro-batch and 14.8 s as two (peak 3.4 and 3.8 GiB; 11.9 s and 5.0 GiB without
        # checkpointing, which run.toml does not take: its memory goal wins). The weights of the
        # step's terms span all its micro-batches, so the gradient is the same sum. A row is never
        # split (its calls' prefixes are one path), so the bound rises to the longest row.
        longest = max(len(ids) for ids, _ in rows)
        packing["max_tokens"] = min(cfg.merge.max_tokens, max(sc.micro_batch_tokens, longest))
    # the NLL of the model's own distribution (temperature 1): sampling.temperature is how a run
    # draws from the model, not what sft fits, and a warm start must not change with it
    sampling = msgspec.structs.replace(cfg.sampling, temperature=1.0)
    learner = build_learner(msgspec.structs.replace(cfg, learner=learner_cfg, sampling=sampling))
    everything = nll_step_batch(rows, **packing)
    before = learner.nll(everything) if measure else float("nan")
    emit("info", {"message": f"sft: {len(rows)} rows, {everything.n_terms} trained tokens, "
                             f"{everything.n_tokens} forwarded per epoch" + (f", nll {before:.4f}" if measure else "")})
    rng = random.Random(sc.seed)
    steps = 0
    epoch_nll = []
    for epoch in range(epochs):
        order = list(range(len(rows)))
        rng.shuffle(order)
        losses = []
        for start in range(0, len(order), sc.rows_per_step):
            batch = nll_step_batch([rows[i] for i in order[start:start + sc.rows_per_step]], **packing)
            metrics = learner.train_step(batch, objective="nll")
            release_free_memory(collect=False)  # the step's freed heap holes (learner/host_memory.py)
            steps += 1
            losses.append(metrics.loss)
            emit("info", {"message": f"sft epoch {epoch + 1}/{epochs} step {steps}: nll {metrics.loss:.4f}"})
        epoch_nll.append(sum(losses) / len(losses))
    before, after = (before, learner.nll(everything)) if measure else (epoch_nll[0], epoch_nll[-1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    learner.policy.lm.save_pretrained(out)
    load_tokenizer(cfg.model.path).save_pretrained(out)
    return SftReport(rows=len(rows), tokens=everything.n_tokens, trained_tokens=everything.n_terms, steps=steps,
                     nll_before=before, nll_after=after, duration_s=time.perf_counter() - started,
                     model_dir=str(out))
