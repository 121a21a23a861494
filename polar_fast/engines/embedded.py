"""An in-process torch model: KV-cache sampling with per-token logprobs (the CPU default).

Choices:
- One generation at a time behind an asyncio lock, run in a worker thread so the event loop
  stays free; torch already uses every core for one sequence on CPU.
- The logprob recorded for a sampled id is log_softmax(logits / temperature), the distribution
  actually sampled (before top-p, which training refuses), which is what the learner recomputes
  at the run's temperature. Temperature 0 is greedy and records the raw (T=1) logprob.
- `update_weights` takes the same lock, so a generation in flight finishes on the old weights and
  its `Generation.policy_version` names the weights that really sampled it.
- A call starts from the KV cache of an earlier call with the same opening tokens (its own
  session's last call, or any session's system prompt): see prefix_cache.py. Prefill keeps only
  the last position's logits, the one sampled from.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Iterable, Sequence

from polar_fast.engines import Generation, Sampling
from polar_fast.engines.prefix_cache import PrefixCache

if TYPE_CHECKING:
    import torch

    from polar_fast.config import EngineConfig, ModelConfig


class EmbeddedEngine:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
        from polar_fast.model import load_model, load_tokenizer

        self._model_cfg = model_cfg
        self._engine_cfg = engine_cfg
        self.model = load_model(model_cfg.path, dtype=engine_cfg.dtype, device=engine_cfg.device)
        self.model.eval()
        tokenizer = load_tokenizer(model_cfg.path)
        self._stop_ids = {tokenizer.eos_token_id} | set(
            _as_list(getattr(self.model.generation_config, "eos_token_id", None))
        )
        self.policy_version = 0
        self.prefix_cache = PrefixCache()
        self._lock = asyncio.Lock()

    @classmethod
    def from_config(cls, model: ModelConfig, engine: EngineConfig) -> EmbeddedEngine:
        return cls(model, engine)

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = ""
    ) -> Generation:
        async with self._lock:
            ids, logprobs, finish = await asyncio.to_thread(self._generate, prompt_ids, sampling)
            return Generation(
                token_ids=ids, logprobs=logprobs, finish_reason=finish, policy_version=self.policy_version
            )

    def _generate(self, prompt_ids: Sequence[int], sampling: Sampling) -> tuple[list[int], list[float], str]:
        import torch
        from transformers import DynamicCache

        stop = self._stop_ids | set(sampling.stop_token_ids)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self._engine_cfg.device).manual_seed(sampling.seed)
        device = self._engine_cfg.device
        prompt = list(prompt_ids)
        cache, reused = self.prefix_cache.take(prompt)
        cache = cache if cache is not None else DynamicCache()
        step_ids = torch.tensor([prompt[reused:]], dtype=torch.long, device=device)
        with torch.inference_mode():
            ids, logprobs, finish = self._decode(step_ids, cache, sampling, stop, generator)
        if ids:  # the cache now holds the prompt and every sampled token but the last (never fed)
            self.prefix_cache.put(prompt + ids[:-1], cache)
        return ids, logprobs, finish

    def _decode(self, step_ids, cache, sampling: Sampling, stop, generator) -> tuple[list[int], list[float], str]:
        import torch

        device = self._engine_cfg.device
        ids: list[int] = []
        logprobs: list[float] = []
        for _ in range(sampling.max_tokens):
            out = self.model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()  # (V,)
            token = _sample(logits, sampling, generator)
            ids.append(token)
            scaled = logits / sampling.temperature if sampling.temperature > 0 else logits
            logprobs.append(torch.log_softmax(scaled, dim=-1)[token].item())
            if token in stop:
                return ids, logprobs, "stop"
            step_ids = torch.tensor([[token]], dtype=torch.long, device=device)
        return ids, logprobs, "length"

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None, *, version: int
    ) -> None:
        async with self._lock:
            await asyncio.to_thread(self._load_weights, named_tensors)
            self.policy_version = version

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        import torch

        from polar_fast.model import load_model

        if named_tensors is None:
            fresh = load_model(self._model_cfg.path, dtype=self._engine_cfg.dtype, device="cpu")
            named_tensors = fresh.state_dict().items()
        self.prefix_cache.clear()  # keys and values of the old weights
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(f"update_weights: the model has no tensor named {name!r}")
                state[name].copy_(tensor)

    async def aclose(self) -> None:
        pass


def _sample(logits, sampling: Sampling, generator) -> int:
    import torch

    if sampling.temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
