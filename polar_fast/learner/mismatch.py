"""The engine/learner mismatch: the figures every step reports, and the gate at a run's first step.

On GPUs the engine and the learner never compute exactly the same logprobs (bf16, different
kernels, and for Gated DeltaNet layers a chunked scan in training against a recurrent one in the
engine). Each step measures the gap at its first forward, before the update, over the sampled
tokens it trains (grpo.py; the per-token parts are losses.mismatch_terms):
- `kl`: the k3 estimate of KL(behaviour || learner), token mean;
- `abs_mean`, `abs_max`: mean and max |log pi_learner - log pi_behaviour|;
- `out_of_clip`: the share of tokens whose ratio pi_learner / pi_behaviour lies outside the PPO
  clip band, the tokens `is_correction = "none"` would train with a zero gradient.
At the first step they hold only the mismatch; later steps also hold staleness (groups sampled by
an older policy version, up to run.max_staleness).

The gate: when a run's first step (and the first after --resume) measures `kl` above
`learner.max_mismatch_kl`, the step raises `MismatchError` before the optimizer update, and the
run stops with one message naming the figure, the likely causes and how to check each. The run
decides whether to gate (train.py: off for the scripted engines, whose logprobs are made up) and
hands a `Gate` to the step; under torchrun the gate travels with the step's message, so every
rank stops at the same point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import msgspec

from polar_fast.errors import PolarError

if TYPE_CHECKING:
    from polar_fast.config import Config


class Figures(NamedTuple):
    """One step's mismatch over its sampled tokens (0 with no tokens)."""

    kl: float
    abs_mean: float
    abs_max: float
    out_of_clip: float
    n_tokens: int


class Gate(msgspec.Struct, frozen=True, kw_only=True):
    """The first step's check: stop before the update when `Figures.kl` exceeds `max_kl`.
    `settings` are the run's values the message quotes (dotted config key -> value)."""

    max_kl: float
    clip_low: float = 0.2
    clip_high: float = 0.28
    settings: dict[str, str] = {}

    @classmethod
    def for_run(cls, cfg: Config) -> Gate:
        e, s, lc = cfg.engine, cfg.sampling, cfg.learner
        settings = {
            "engine.kind": e.kind, "engine.dtype": e.dtype, "learner.dtype": lc.dtype,
            "learner.attention": lc.attention, "sampling.temperature": f"{s.temperature:g}",
            "sampling.top_p": f"{s.top_p:g}", "engine.url": e.url or '""', "engine.render": e.render,
            "model.path": cfg.model.path or '"" (SmolLM2)',
        }
        return cls(max_kl=lc.max_mismatch_kl, clip_low=lc.clip_low, clip_high=lc.clip_high, settings=settings)


class MismatchError(PolarError):
    """The engine's behaviour logprobs and the learner's disagree too much to train on (the gate)."""

    def __init__(self, message: str, figures: Figures) -> None:
        super().__init__(message)
        self.figures = figures


def check(figures: Figures, gate: Gate) -> None:
    """Raise MismatchError when the figures fail the gate (max_kl 0: never)."""
    if gate.max_kl > 0 and figures.n_tokens and figures.kl > gate.max_kl:
        raise MismatchError(message(figures, gate), figures)


def message(f: Figures, gate: Gate) -> str:
    """The gate's one message: the figures, then each likely cause with how to check it."""
    quote = ", ".join(f"{k} = {v}" for k, v in gate.settings.items())
    low, high = 1 - gate.clip_low, 1 + gate.clip_high
    return (
        f"the engine and the learner disagree on the sampled tokens before the first update: mismatch KL "
        f"{f.kl:.4g} (k3 estimate of KL(behaviour || learner), mean over {f.n_tokens} tokens) > "
        f"learner.max_mismatch_kl = {gate.max_kl:g}; mean |delta logprob| {f.abs_mean:.3g}, max {f.abs_max:.3g}; "
        f"{100 * f.out_of_clip:.1f}% of tokens outside the clip band [{low:g}, {high:g}]. The run stopped before "
        f"training.{f' This run: {quote}.' if quote else ''} Likely causes, and how to check each:\n"
        "- dtype: the engine samples in one precision and the learner computes in another. Serve and train in the "
        "same dtype (engine.dtype, learner.dtype); bench/gpu_check.py measures what bf16 alone costs (its "
        "mismatch row: a bf16 learner against an fp32 forward of the same batch).\n"
        "- temperature or top-p not owned by the run: the learner computes logprobs at sampling.temperature with no "
        "top-p or top-k. A vLLM started by hand (engine.url set) applies the model's generation_config.json unless "
        "started with --generation-config vllm, and records logprobs before the temperature unless started with "
        "--logprobs-mode processed_logprobs. Leave engine.url empty so polar_fast starts it "
        "(engines/vllm_launch.py), or start it with those flags.\n"
        "- the chat template or the weights: the engine serves another model, revision or template than "
        "model.path (engine.render = \"engine\" renders with vLLM's template). Check that the engine serves "
        "model.path's files; in `view`, a gap concentrated at the first tokens of each turn points here.\n"
        "- a kernel: attention or the Gated DeltaNet scan differs between engine and learner (vLLM fixed a "
        "rounding bug in Qwen3.5's packed decode only in August, vllm#53877: update it). Rerun with learner.attention = "
        "\"sdpa\" and compare, and run bench/gpu_check.py on the device.\n"
        "To train anyway: raise learner.max_mismatch_kl (0 turns the gate off), with learner.is_correction = \"tis\" "
        "or \"mask\" so the gap is corrected (docs/learning.md, \"Engine/learner mismatch\")."
    )
