"""The run's sampling for one call (engines.Sampling), decided from the config and the request.

Sampling belongs to the run: `[sampling]` sets temperature, top_p and a hard per-call max_tokens
cap, and what the harness asked for is used only with `sampling.from_harness` (it is recorded in
the call record either way). max_tokens is also capped by the context the prompt leaves, and a
prompt that leaves none is refused with the wording the harnesses compact on. A seeded run seeds
each call from stable ids, so a group's rollouts differ and a rerun repeats.
"""

from __future__ import annotations

import hashlib
import math

from polar_fast.capture.dialects import DialectError
from polar_fast.capture.session import Session
from polar_fast.config import Config
from polar_fast.conversation import Conversation
from polar_fast.engines import Sampling


def call_seed(run_seed: int, rollout_id: str, call_index: int) -> int:
    """The seed of one call of a seeded run: the rollouts of a group (same prompt) must not sample
    alike, and a rerun of the run must sample the same, so it derives from stable ids."""
    digest = hashlib.blake2b(f"{run_seed}:{rollout_id}:{call_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: every engine takes it


def sampling_for(cfg: Config, conv: Conversation, prompt_len: int, session: Session | None = None) -> Sampling:
    """How to sample one call whose prompt has `prompt_len` tokens; DialectError (400) on a bad
    request, kind "context_length" when the prompt leaves no room to answer."""
    s = cfg.sampling
    temperature, top_p = s.temperature, s.top_p  # the run's sampling (config.SamplingConfig)
    if s.from_harness:
        temperature = s.temperature if conv.temperature is None else conv.temperature
        top_p = s.top_p if conv.top_p is None else conv.top_p
    if not (math.isfinite(temperature) and 0 <= temperature <= 100):
        raise DialectError(f"temperature must be a number in [0, 100], got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise DialectError(f"top_p must be in (0, 1], got {top_p}")
    if conv.max_tokens is not None and conv.max_tokens < 1:
        raise DialectError(f"max_tokens must be at least 1, got {conv.max_tokens}")
    context = cfg.model.max_context_tokens
    if prompt_len >= context:
        # Anthropic's wording first (Claude Code compacts and retries on it), then OpenAI's (Pi
        # matches "maximum context length is N tokens"; Qwen Code also reads the error code).
        raise DialectError(
            f"prompt is too long: {prompt_len} tokens > {context} maximum (this model's maximum "
            f"context length is {context} tokens)",
            kind="context_length",
        )
    max_tokens = min(conv.max_tokens or s.max_tokens, s.max_tokens, context - prompt_len)
    seed = conv.seed if conv.seed is not None else s.seed
    if conv.seed is None and s.seed is not None and session is not None:
        seed = call_seed(s.seed, session.rollout_id, session.n_calls)
    return Sampling(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
