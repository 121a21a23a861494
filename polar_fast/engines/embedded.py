"""An in-process torch model that decodes concurrent calls together (the CPU default).

Continuous batching. A scheduler thread owns the model. Each of its steps forwards one packed
row of tokens: the next token of every running call, plus up to `engine.prefill_chunk_tokens`
tokens of the prompts of calls that are joining. A call that arrives while others decode joins
at the next step; a call that finishes leaves at once, and its slot goes to the next waiting call
(at most `engine.max_batch` calls in the batch). One forward serves all of them, so each weight
is read once per step for the whole batch: on a CPU a decode step costs about as much for eight
calls as for one. Attention keeps calls apart (batched_attention.py): each call has its own KV
cache; calls that share a prefix (the harness's system prompt) read one shared copy of it, all
their queries in one SDPA call against it, then each its own part, merged by log-sum-exp
(cascade attention).

Prefill is chunked and shares the step with decode, rather than running as a step of its own:
a joining call's ~1-2k-token prompt would otherwise stall every running call for seconds (a
256-token chunk costs about as much as six decode steps of SmolLM2-135M on 2 cores). The chunk
is a fixed number of tokens per step whatever the batch holds, so a call is prefilled in the same
pieces alone or in company.

Per call: its own KV cache, started from the prefix cache (prefix_cache.py: its session's last
call, or any session's system prompt) and handed back to it when the call ends; its own stop ids,
temperature and top-p; its own torch.Generator (seeded from `sampling.seed`, else from the OS), so
which calls share its steps never changes what it samples. The recorded logprob of a sampled id is
log_softmax(logits / temperature), the distribution actually sampled (before top-p, which training
refuses); temperature 0 is greedy and records the raw (T=1) logprob.

Weight updates wait for the batch to drain: from the moment an update arrives no call joins, the
running calls finish (at most their max_tokens steps), the weights are loaded and the prefix cache
is dropped (it holds keys and values of the old weights), then waiting calls join again. Every
token of a call is therefore sampled by one set of weights, and `Generation.policy_version` names
them; `version_changes` stays empty. Applying an update between two steps would also need the
calls in flight re-prefilled under the new weights, which on a CPU costs more than the wait.

The forward itself is decode_step.py's: for Llama-shaped models (SmolLM2) a fused loop over the
weights, in float32 or the learner's bf16 autocast recipe (`engine.dtype`), optionally compiled
(`engine.compile`). Models: any HF causal LM whose layers all go through transformers' attention
interface (Llama, Qwen2/3, Mistral without sliding windows, ...). Hybrid models (Gated DeltaNet
layers) are refused: serve them with vLLM.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import msgspec

from polar_fast.engines import EngineError, EngineFailed, EngineUnavailable, Generation, Sampling
from polar_fast.engines.prefix_cache import PrefixCache, common_prefix

if TYPE_CHECKING:
    import torch

    from polar_fast.config import EngineConfig, ModelConfig

DEFAULT_MAX_BATCH = 8


class EmbeddedStatistics(msgspec.Struct, frozen=True, kw_only=True):
    steps: int  # forwards run
    decoded_tokens: int  # tokens sampled
    prefill_tokens: int  # prompt tokens forwarded (the prefix cache's reuse excluded)
    batch_tokens_max: int  # largest number of calls decoded in one step
    mean_batch: float  # calls decoded per step, on average over steps that decoded
    running: int  # calls in the batch now (decoding or prefilling)
    waiting: int  # calls queued for a slot


@dataclass(eq=False)
class _Call:
    prompt: list[int]
    sampling: Sampling
    stop: frozenset[int]
    generator: Any  # torch.Generator
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    kv: Any = None  # batched_attention.CallKV, once admitted
    version: int = 0
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False

    @property
    def prefilling(self) -> bool:
        return self.kv is None or self.kv.length < len(self.prompt)

    def tokens_in_cache(self) -> list[int]:
        return (self.prompt + self.ids)[: self.kv.length] if self.kv is not None else []


@dataclass(eq=False)
class _Update:
    named_tensors: Iterable[tuple[str, Any]] | None
    version: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EmbeddedEngine:
    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, *, fused: bool = True) -> None:
        """`fused=False`: transformers' own forward even where the fused step applies (the
        reference bench/engine_bench.py measures the fused step against)."""
        from polar_fast.engines import decode_step
        from polar_fast.model import load_model, load_tokenizer

        self._model_cfg = model_cfg
        self._engine_cfg = engine_cfg
        # float32 in: the step keeps what it computes in float32 so (decode_step.py, "Precision")
        self.model = load_model(model_cfg.path, dtype="float32", device=engine_cfg.device)
        _check_batchable(self.model)
        self.model.eval()
        self.max_batch = engine_cfg.max_batch or DEFAULT_MAX_BATCH
        self.forward = decode_step.for_model(self.model, dtype=engine_cfg.dtype, compile=engine_cfg.compile,
                                             fused=fused, rows=self.max_batch)
        tokenizer = load_tokenizer(model_cfg.path)
        self._stop_ids = {tokenizer.eos_token_id} | set(
            _as_list(getattr(self.model.generation_config, "eos_token_id", None))
        )
        config = self.model.config
        self._rep = config.num_attention_heads // config.num_key_value_heads  # query heads per key head
        self.prefill_chunk_tokens = engine_cfg.prefill_chunk_tokens
        self.policy_version = 0
        self.prefix_cache = PrefixCache()
        self._inbox: queue.SimpleQueue[_Call | _Update | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stats = dict(steps=0, decoded_tokens=0, prefill_tokens=0, batch_tokens_max=0, decode_steps=0,
                           running=0, waiting=0)

    @classmethod
    def from_config(cls, model: ModelConfig, engine: EngineConfig) -> EmbeddedEngine:
        return cls(model, engine)

    # ------------------------------------------------------------------ the event loop's side

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = ""
    ) -> Generation:
        import torch

        if not len(prompt_ids):
            raise EngineFailed("the embedded engine needs at least one prompt token")
        if sampling.max_tokens <= 0:
            return Generation(token_ids=[], logprobs=[], finish_reason="length", policy_version=self.policy_version)
        generator = torch.Generator(device=self._engine_cfg.device)
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()  # from the OS: unseeded calls still draw from a stream of their own
        loop = asyncio.get_running_loop()
        call = _Call(list(prompt_ids), sampling, frozenset(self._stop_ids | set(sampling.stop_token_ids)),
                     generator, loop, loop.create_future())
        self._send(call)
        try:
            return await call.future
        except asyncio.CancelledError:
            call.cancelled = True  # the scheduler drops it at its next step
            raise

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None, *, version: int
    ) -> None:
        loop = asyncio.get_running_loop()
        update = _Update(named_tensors, version, loop, loop.create_future())
        self._send(update)
        await update.future

    def statistics(self) -> EmbeddedStatistics:
        s = self._stats
        return EmbeddedStatistics(
            steps=s["steps"], decoded_tokens=s["decoded_tokens"], prefill_tokens=s["prefill_tokens"],
            batch_tokens_max=s["batch_tokens_max"],
            mean_batch=s["decoded_tokens"] / s["decode_steps"] if s["decode_steps"] else 0.0,
            running=s["running"], waiting=s["waiting"],
        )

    async def aclose(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def _send(self, item: _Call | _Update) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="embedded-engine", daemon=True)
            self._thread.start()
        self._inbox.put(item)

    # ------------------------------------------------------------------- the scheduler thread

    def _serve(self) -> None:
        import torch

        if self._engine_cfg.threads:  # per thread: the learner's own thread keeps its setting
            torch.set_num_threads(self._engine_cfg.threads)
        waiting: deque[_Call] = deque()
        batch: list[_Call] = []
        updates: deque[_Update] = deque()
        while True:
            batch = [c for c in batch if not _dropped(c)]
            self._stats.update(running=len(batch), waiting=len(waiting))
            if self._receive(waiting, updates, block=not (batch or updates or waiting)):
                break
            if updates and not batch:  # drained: no call spans the new weights
                self._apply(updates.popleft())
                continue
            while not updates and waiting and len(batch) < self.max_batch:
                call = waiting.popleft()
                if not _dropped(call):
                    call.version = self.policy_version
                    batch.append(call)
            self._stats.update(running=len(batch), waiting=len(waiting))
            if batch:
                try:
                    with torch.inference_mode():
                        batch = self._step(batch)
                except Exception as e:  # noqa: BLE001 - a failed step fails its calls, never the engine
                    for call in batch:
                        _fail(call, EngineFailed(f"embedded engine step failed: {type(e).__name__}: {e}"))
                    batch = []
        for item in [*batch, *waiting, *updates]:
            _fail(item, EngineUnavailable("the embedded engine was closed"))

    def _receive(self, waiting: deque[_Call], updates: deque[_Update], *, block: bool) -> bool:
        """Moves new calls and updates off the inbox; True once the engine was closed."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return False
            block = False
            if item is None:
                return True
            if isinstance(item, _Update):
                updates.append(item)
            else:
                waiting.append(item)

    def _start(self, call: _Call, batch: list[_Call]) -> None:
        """The call's KV cache, when its prefill begins: the longest prefix of its prompt already
        computed, in the prefix cache or in a batch-mate's cache (calls that join together share
        a system prompt, which is then prefilled once, not once per call)."""
        from polar_fast.engines.batched_attention import CallKV

        needed = len(call.prompt) + call.sampling.max_tokens
        cache, reused = self.prefix_cache.take(call.prompt)
        for other in batch:
            if other is not call and other.kv is not None:
                n = min(common_prefix(other.tokens_in_cache(), call.prompt), len(call.prompt) - 1)
                if n > reused:
                    cache, reused = other.kv.copy_prefix(n), n
        call.kv = cache if cache is not None else CallKV.for_model(
            self.model.config, dtype=self.forward.dtype, device=self._engine_cfg.device, capacity=needed)
        call.kv.reserve(needed)  # once, so the cache never grows while the call decodes

    def _step(self, batch: list[_Call]) -> list[_Call]:
        """One forward over the batch; returns the calls still running."""
        import torch

        from polar_fast.engines.batched_attention import Segment, StepPlan

        tokens: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        samplers: list[tuple[_Call, int]] = []  # (call, packed row whose logits it samples from)
        budget = self.prefill_chunk_tokens
        for call in batch:
            if call.prefilling:
                if budget <= 0:
                    continue
                if call.kv is None:
                    self._start(call, batch)
                start = call.kv.length
                chunk = call.prompt[start : start + budget]
                budget -= len(chunk)
                self._stats["prefill_tokens"] += len(chunk)
            else:
                start, chunk = call.kv.length, call.ids[-1:]
            segments.append(Segment(call.kv, len(tokens), len(tokens) + len(chunk)))
            tokens.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            if start + len(chunk) >= len(call.prompt):  # the prompt is in: this row gives the next token
                samplers.append((call, len(tokens) - 1))
        plan = StepPlan.of(segments, self._engine_cfg.device, self.forward.dtype, rep=self._rep)
        logits = self.forward.logits(tokens, positions, plan, [row for _, row in samplers])  # (B, V)
        plan.commit()
        self._stats["steps"] += 1
        if samplers:
            if softcap := getattr(self.model.config, "final_logit_softcapping", None):
                logits = torch.tanh(logits / softcap) * softcap
            self._sample_into([call for call, _ in samplers], logits)
            self._stats["decoded_tokens"] += len(samplers)
            self._stats["decode_steps"] += 1
            self._stats["batch_tokens_max"] = max(self._stats["batch_tokens_max"], len(samplers))
        return [c for c in batch if not self._finish_if_done(c)]

    def _sample_into(self, calls: list[_Call], logits: torch.Tensor) -> None:
        """Each call's next id and its logprob, from its row of logits (B, V), in a few ops for the
        whole batch: row-wise kernels compute a row alike in any batch, and each call's noise
        comes from its own generator, so batch-mates never change what a call samples."""
        import torch

        temperatures = torch.tensor([[c.sampling.temperature if c.sampling.temperature > 0 else 1.0] for c in calls])
        scaled = logits / temperatures
        logp = torch.log_softmax(scaled, dim=-1)  # (B, V)
        ids: list[int | None] = [None] * len(calls)
        plain = [i for i, c in enumerate(calls) if c.sampling.temperature > 0 and c.sampling.top_p >= 1.0]
        if plain:
            # argmax(p / E) with E ~ Exp(1) per entry is an exact sample of p (what torch.multinomial
            # does); E = -log(U) from the call's own generator costs a quarter of multinomial's
            # exponential_. Unlike an inverse-CDF draw, the choice flips only when two candidates tie
            # within the logits' rounding, so a call samples the same ids whatever batch computed them.
            rows = torch.tensor(plain)
            probs = torch.softmax(scaled.index_select(0, rows), dim=-1)
            noise = torch.empty_like(probs)
            for j, i in enumerate(plain):
                torch.rand(probs.shape[1], generator=calls[i].generator, out=noise[j])
            for i, token in zip(plain, torch.argmax(probs / noise.log_().neg_(), dim=-1).tolist()):
                ids[i] = token
        for i, call in enumerate(calls):
            if ids[i] is None:  # greedy, or top-p: one row at a time
                ids[i] = _sample(logits[i], call.sampling, call.generator)
        chosen = logp[torch.arange(len(calls)), torch.tensor(ids)].tolist()
        for call, token, lp in zip(calls, ids, chosen):
            call.ids.append(token)
            call.logprobs.append(lp)

    def _finish_if_done(self, call: _Call) -> bool:
        if _dropped(call):
            return True
        if not call.ids or call.prefilling:
            return False
        if call.ids[-1] in call.stop:
            finish = "stop"
        elif len(call.ids) >= call.sampling.max_tokens:
            finish = "length"
        else:
            return False
        # the cache now holds the prompt and every sampled token but the last (never fed)
        self.prefix_cache.put(call.prompt + call.ids[:-1], call.kv)
        _resolve(call, Generation(token_ids=call.ids, logprobs=call.logprobs, finish_reason=finish,
                                  policy_version=call.version))
        return True

    def _apply(self, update: _Update) -> None:
        try:
            self._load_weights(update.named_tensors)
        except Exception as e:  # noqa: BLE001 - handed to the caller of update_weights
            _fail(update, e)
            return
        self.policy_version = update.version
        _resolve(update, None)

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        import torch

        from polar_fast.model import load_model

        if named_tensors is None:
            fresh = load_model(self._model_cfg.path, dtype="float32", device="cpu")
            named_tensors = fresh.state_dict().items()
        self.prefix_cache.clear()  # keys and values of the old weights
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(f"update_weights: the model has no tensor named {name!r}")
                state[name].copy_(tensor)  # into the step's packed weights too: they are views
            self.forward.refresh()


def _check_batchable(model: Any) -> None:
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention"}:
        raise EngineError(
            f"the embedded engine batches attention-only models; {type(model).__name__} has "
            f"{sorted(kinds - {'full_attention'})} layers: serve it with engine.kind = \"vllm\"")


def _dropped(call: _Call) -> bool:
    return call.cancelled or call.future.cancelled()


def _resolve(item: _Call | _Update, value: Any) -> None:
    item.loop.call_soon_threadsafe(_set_result, item.future, value)


def _fail(item: _Call | _Update, error: BaseException) -> None:
    item.loop.call_soon_threadsafe(_set_exception, item.future, error)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _sample(logits, sampling: Sampling, generator) -> int:
    import torch

    if sampling.temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    # the draw EmbeddedEngine._sample_into makes for a whole batch, for one row
    noise = torch.rand(probs.shape, generator=generator, device=probs.device).log_().neg_()
    return int(torch.argmax(probs / noise).item())


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
