"""Inference engines: the proxy hands them prompt token ids and gets sampled ids + logprobs back.

Every engine follows one small async Protocol (`Engine`). `ENGINES` maps the config's
`engine.kind` to a class; each class has `from_config(cfg)`. Engine failures are the only errors
the proxy turns into 5xx replies: `EngineUnavailable` (down, refused, 5xx after retries: 503),
`EngineTimeout` (504) and `EngineFailed` (anything else the engine reports: 502).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import msgspec

from polar_fast.errors import PolarError

if TYPE_CHECKING:
    import torch

    from polar_fast.config import EngineConfig, ModelConfig


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024  # completion tokens at most
    stop_token_ids: list[int] = []  # besides the model's own end-of-turn tokens
    seed: int | None = None


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    token_ids: list[int]  # sampled ids, including the stop token when one ended generation
    logprobs: list[float]  # behaviour logprob of each sampled id
    finish_reason: str  # "stop" | "length" | "abort"
    # Weights version that sampled these ids, when the engine knows it exactly (None = read
    # `engine.policy_version` instead). Set by engines whose weights can change mid-request.
    policy_version: int | None = None
    # (index, version): completion token `index` and the ones after it were sampled by `version`
    # (a weight sync happened while this call was generating; vLLM's pause mode "keep").
    version_changes: list[tuple[int, int]] = []


class EngineError(PolarError):
    """The engine could not produce a generation. `status` is the HTTP status the proxy answers."""

    status = 502


class EngineUnavailable(EngineError):
    status = 503


class EngineTimeout(EngineError):
    status = 504


class EngineFailed(EngineError):
    status = 502


class Engine(Protocol):
    policy_version: int

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = ""
    ) -> Generation:
        """`prompt_ids` is a list or, from the proxy, an `array("i")`; never mutated."""
        ...

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None, *, version: int
    ) -> None: ...

    async def aclose(self) -> None: ...


# Imported after the definitions above, which these modules use. None imports torch or vllm at
# import time, so this map stays cheap.
from polar_fast.engines.embedded import EmbeddedEngine  # noqa: E402
from polar_fast.engines.scripted import ScriptedEngine  # noqa: E402
from polar_fast.engines.replicated import ReplicatedEngine  # noqa: E402
from polar_fast.engines.vllm import VllmEngine  # noqa: E402

ENGINES: dict[str, type] = {"embedded": EmbeddedEngine, "scripted": ScriptedEngine, "vllm": VllmEngine}


def build_engine(model: ModelConfig, engine: EngineConfig) -> Engine:
    """The engine named by `engine.kind`, serving `model`; for "vllm" with `engine.urls`, one
    engine over those replicas (replicated.py)."""
    try:
        cls = ENGINES[engine.kind]
    except KeyError:
        raise EngineError(f"unknown engine kind {engine.kind!r}; known: {sorted(ENGINES)}") from None
    if cls is VllmEngine and engine.urls:
        cls = ReplicatedEngine
    return cls.from_config(model, engine)
