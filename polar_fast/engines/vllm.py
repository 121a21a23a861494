"""HTTP client to a running `vllm serve` (OpenAI-compatible server). Never imports vllm.

- `generate`: POST /inference/v1/generate (vLLM's token-in/token-out route, mounted by
  `--enable-scale-out`) with the prompt as token ids and `logprobs: 0` (the logprob of each
  sampled token). Its reply also says which weight version sampled which tokens
  (`weight_versions` spans), so a call that spans a weight sync records where the version
  changed. The prompt's JSON is mostly reused from the session's last call (vllm_wire.py).
- A session sticks to one data-parallel rank through the `X-data-parallel-rank` header (a stable
  hash of the session id), so its growing prompts hit the same prefix cache.
- Connection errors and 5xx replies are retried `engine.max_retries` times, then become
  `EngineUnavailable`; a call past `engine.timeout_s` becomes `EngineTimeout`. Plain http:// goes
  through a small keep-alive HTTP/1.1 client (http1.py, a fraction of aiohttp's CPU per call);
  https:// through aiohttp.
- `chat` is for `render = "engine"`: the canonical conversation goes to /v1/chat/completions
  with `return_token_ids`, and vLLM's own template and parsers produce the reply.
- `update_weights(None, version)` makes the server reload its weights from disk without losing
  a call in flight (dev-mode routes, each step bounded by `engine.sync_timeout_s`):
  /pause?mode=keep (in-flight requests are frozen, not aborted: vLLM's default mode is abort),
  /collective_rpc reload_weights, /reset_prefix_cache?reset_running_requests=true (frozen
  requests drop their KV and recompute it under the new weights, so every token sampled after
  the sync comes from the new policy alone), /update_weight_version (the label vLLM stamps on
  the tokens sampled from then on), /resume. A failed step resumes the engine and raises
  WeightSyncError naming the step. `engine.pause_mode = "wait"` lets in-flight requests finish
  on the old weights instead (the sync then waits for the longest one).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Sequence

import msgspec

from polar_fast.engines import EngineFailed, EngineTimeout, EngineUnavailable, Generation, Sampling
from polar_fast.engines.http1 import Http1Pool
from polar_fast.engines.vllm_wire import PromptJsonCache
from polar_fast.errors import WeightSyncError

if TYPE_CHECKING:
    import aiohttp

    from polar_fast.config import EngineConfig, ModelConfig


class _Logprob(msgspec.Struct):
    logprob: float


class _LogprobsView(msgspec.Struct):
    content: list[_Logprob] | None = None


class _VersionSpan(msgspec.Struct):
    version: str  # the label /update_weight_version set; tokens [start, end) were sampled by it
    start: int
    end: int


class _GenerateChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _LogprobsView | None = None
    finish_reason: str | None = None
    weight_versions: list[_VersionSpan] | None = None


class _GenerateReply(msgspec.Struct):
    choices: list[_GenerateChoice]


class ChatReply(msgspec.Struct):
    """What `render = "engine"` needs from vLLM's chat reply."""

    prompt_ids: list[int]
    generation: Generation
    message: dict[str, Any]  # vLLM's parsed assistant message (content, reasoning, tool_calls)


_generate_decoder = msgspec.json.Decoder(_GenerateReply)
PAUSE_MODES = ("keep", "wait")


class VllmEngine:
    def __init__(
        self,
        url: str,
        *,
        model: str,
        timeout_s: float = 600.0,
        max_retries: int = 2,
        data_parallel_size: int = 1,
        retry_delay_s: float = 0.5,
        pause_mode: str = "keep",
        sync_timeout_s: float = 300.0,
    ) -> None:
        if not url:
            raise EngineUnavailable("engine.url is empty: point it at a running `vllm serve`")
        self.url = url.rstrip("/")
        self.model = model
        self.policy_version = 0
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._dp_size = max(1, data_parallel_size)
        self._retry_delay_s = retry_delay_s
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES} (abort would fail the calls in flight), got {pause_mode!r}")
        self._pause_mode = pause_mode
        self._sync_timeout_s = sync_timeout_s
        self._http: aiohttp.ClientSession | None = None  # https only
        self._pool = Http1Pool(self.url) if self.url.startswith("http://") else None
        self._prompt_json = PromptJsonCache()

    @classmethod
    def from_config(cls, model: ModelConfig, engine: EngineConfig) -> VllmEngine:
        e = engine
        return cls(
            e.url,
            model=model.name,
            timeout_s=e.timeout_s,
            max_retries=e.max_retries,
            data_parallel_size=e.data_parallel_size,
            pause_mode=e.pause_mode,
            sync_timeout_s=e.sync_timeout_s,
        )

    def _session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._http is None:
            # no timeout of its own (aiohttp's default is 5 min): _post bounds every call
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._http

    def rank_of(self, session_id: str) -> int:
        return zlib.crc32(session_id.encode()) % self._dp_size

    async def _post(self, path: str, body: dict[str, Any] | None, *, session_id: str = "",
                    timeout_s: float | None = None, method: str = "POST") -> bytes:
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        headers = {"Content-Type": "application/json"}
        if self._dp_size > 1:
            headers["X-data-parallel-rank"] = str(self.rank_of(session_id))
        data = msgspec.json.encode(body) if method == "POST" else b""
        last = ""
        for attempt in range(self._max_retries + 1):
            if attempt:
                await asyncio.sleep(self._retry_delay_s * attempt)
            try:
                async with asyncio.timeout(timeout_s):
                    status, payload = await self._send(method, path, data, headers)
            except TimeoutError:
                raise EngineTimeout(f"vLLM {path} did not answer within {timeout_s} s") from None
            except OSError as e:  # refused, reset, unreadable reply (HttpError, aiohttp's errors)
                last = f"{type(e).__name__}: {e}"
                continue
            if status < 300:
                return payload
            last = f"HTTP {status}: {payload[:300].decode(errors='replace')}"
            if status < 500:
                raise EngineFailed(f"vLLM {path} refused the request: {last}")
        raise EngineUnavailable(f"vLLM at {self.url} unavailable after {self._max_retries + 1} tries: {last}")

    async def _send(self, method: str, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        if self._pool is not None:
            return await (self._pool.post(path, data, headers) if method == "POST" else self._pool.get(path, headers))
        import aiohttp  # https: aiohttp's client

        try:
            async with self._session().request(method, self.url + path, data=data or None, headers=headers) as r:
                return r.status, await r.read()
        except aiohttp.ClientError as e:
            raise OSError(f"{type(e).__name__}: {e}") from None

    @staticmethod
    def _shared_sampling(sampling: Sampling) -> dict[str, Any]:
        """What both routes (chat and /inference/v1/generate) take the same way."""
        fields: dict[str, Any] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "skip_special_tokens": False,
        }
        if sampling.stop_token_ids:
            fields["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            fields["seed"] = sampling.seed
        return fields

    def _sampling_fields(self, sampling: Sampling) -> dict[str, Any]:
        return {"model": self.model, **self._shared_sampling(sampling), "return_token_ids": True}

    def _sampling_params(self, sampling: Sampling) -> dict[str, Any]:
        return {**self._shared_sampling(sampling), "logprobs": 0, "detokenize": False}

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = ""
    ) -> Generation:
        body = {"model": self.model, "token_ids": msgspec.Raw(self._prompt_json.json(session_id, prompt_ids)),
                "sampling_params": self._sampling_params(sampling), "output_mode": "tokens"}
        version = self.policy_version  # the weights at the start; the reply's spans say more
        raw = await self._post("/inference/v1/generate", body, session_id=session_id)
        try:
            choice = _generate_decoder.decode(raw).choices[0]
        except (msgspec.DecodeError, IndexError) as e:
            raise EngineFailed(f"vLLM sent an unreadable generation: {e}") from None
        ids = choice.token_ids or []
        logprobs = [c.logprob for c in (choice.logprobs.content or [])] if choice.logprobs else []
        if len(logprobs) != len(ids):
            raise EngineFailed(f"vLLM returned {len(ids)} token ids but {len(logprobs)} logprobs")
        first, changes = version_changes(choice.weight_versions or [], version)
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=_finish(choice.finish_reason),
                          policy_version=first, version_changes=changes)

    async def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, session_id: str = ""
    ) -> ChatReply:
        body = self._sampling_fields(sampling) | {"messages": messages, "logprobs": True, "top_logprobs": 0}
        if tools:
            body["tools"] = tools
        raw = await self._post("/v1/chat/completions", body, session_id=session_id)
        try:
            reply = msgspec.json.decode(raw)
            choice = reply["choices"][0]
            ids = list(choice["token_ids"])
            logprobs = [float(c["logprob"]) for c in (choice.get("logprobs") or {}).get("content") or []]
            prompt_ids = list(reply["prompt_token_ids"])
            message = dict(choice["message"])
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineFailed(f"vLLM sent an unreadable chat reply ({type(e).__name__}: {e})") from None
        if len(logprobs) != len(ids):
            raise EngineFailed(f"vLLM returned {len(ids)} token ids but {len(logprobs)} logprobs")
        gen = Generation(token_ids=ids, logprobs=logprobs, finish_reason=_finish(choice.get("finish_reason")))
        return ChatReply(prompt_ids=prompt_ids, generation=gen, message=message)

    async def update_weights(self, named_tensors: Iterable | None, *, version: int) -> None:
        if named_tensors is not None:
            raise NotImplementedError("vllm engine: pushing tensors needs a weight-transfer backend; pass None to reload from disk")
        async with self.paused(version):
            await self.control("reload weights", "/collective_rpc", {"method": "reload_weights"})

    def paused(self, version: int) -> contextlib.AbstractAsyncContextManager[None]:
        """`paused` (below) in this engine's pause mode: the block loads new weights, by disk
        reload (update_weights) or by the learner's weight transfer (learner/weight_sync.py)."""
        return paused(self, version, pause_mode=self._pause_mode)

    async def control(self, step: str, path: str, body: dict[str, Any] | None = None, *, method: str = "POST") -> bytes:
        """One dev-mode call of a weight sync: `engine.sync_timeout_s`, and any failure is a
        WeightSyncError naming `step`."""
        try:
            return await self._post(path, body, timeout_s=self._sync_timeout_s, method=method)
        except EngineTimeout:
            raise WeightSyncError(f"weight sync: {step} ({path}) did not answer within {self._sync_timeout_s} s "
                                  "(engine.sync_timeout_s)") from None
        except (EngineFailed, EngineUnavailable) as e:
            raise WeightSyncError(f"weight sync: {step} ({path}) failed: {e}") from None

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._http is not None:
            await self._http.close()
            self._http = None


@contextlib.asynccontextmanager
async def paused(engine: VllmEngine, version: int, *, pause_mode: str = "keep") -> AsyncIterator[None]:
    """Generation paused for a weight update (the block loads the weights), then the prefix cache
    reset, the version label set and generation resumed; see the module docstring. The engine's
    `policy_version` becomes `version` only when every step succeeded. On any failure the engine
    is resumed (a failed resume is named too) and the error says which step failed."""
    await engine.control("pause", f"/pause?mode={pause_mode}&clear_cache=false")
    try:
        yield
        reply = await engine.control("reset prefix cache", "/reset_prefix_cache?reset_running_requests=true")
        if not msgspec.json.decode(reply or b"{}").get("success", True):
            raise WeightSyncError("weight sync: vLLM could not reset its prefix cache (reset_prefix_cache said success=false)")
        await engine.control("set the weight version", "/update_weight_version", {"new_version": str(version)})
    except BaseException as e:
        try:
            await engine.control("resume after a failed sync", "/resume")
        except WeightSyncError as resume_error:
            raise WeightSyncError(f"{e}; and then {resume_error}: the engine may still be paused") from e
        raise
    await engine.control("resume", "/resume")
    engine.policy_version = version


def version_changes(spans: Sequence[_VersionSpan], version: int) -> tuple[int, list[tuple[int, int]]]:
    """(version of the first sampled token, [(index, version) where a new version starts]) from
    vLLM's `weight_versions` spans. Tokens no span labels (sampled before any label was set)
    and labels that are not ours (not integers) count as `version`, the one at the call's start."""
    first, changes, current = version, [], version
    for span in spans:
        try:
            label = int(span.version)
        except ValueError:
            continue
        if span.start == 0:
            first = current = label
        elif label != current:
            changes.append((span.start, label))
            current = label
    return first, changes


def _finish(reason: str | None) -> str:
    # vLLM says "stop" for EOS and stop tokens, "length" at max_tokens, "abort" when cancelled.
    return reason if reason in ("stop", "length", "abort") else "stop"
