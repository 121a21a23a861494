"""HTTP client to a running `vllm serve` (OpenAI-compatible server). Never imports vllm.

- `generate`: POST /v1/completions with the prompt as token ids, `return_token_ids` and
  `logprobs=0` (vLLM then returns the logprob of each sampled token), `skip_special_tokens=false`.
  The prompt's JSON is mostly reused from the session's last call and vLLM's echo of it is cut
  before decoding (vllm_wire.py): both were the larger part of the proxy's work per call.
- A session sticks to one data-parallel rank through the `X-data-parallel-rank` header (a stable
  hash of the session id), so its growing prompts hit the same prefix cache.
- Connection errors and 5xx replies are retried `engine.max_retries` times, then become
  `EngineUnavailable`; a call past `engine.timeout_s` becomes `EngineTimeout`. Plain http:// goes
  through a small keep-alive HTTP/1.1 client (http1.py, a fraction of aiohttp's CPU per call);
  https:// through aiohttp.
- `chat` is for `render = "engine"`: the canonical conversation goes to /v1/chat/completions
  with `return_token_ids`, and vLLM's own template and parsers produce the reply.
- `update_weights(None, version)` asks the server to reload its weights from disk (dev-mode
  endpoints /pause, /collective_rpc reload_weights, /reset_prefix_cache, /resume). Pushing
  tensors over the network needs a weight-transfer backend and is not done here.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import msgspec

from polar_fast.engines import EngineFailed, EngineTimeout, EngineUnavailable, Generation, Sampling
from polar_fast.engines.http1 import Http1Pool
from polar_fast.engines.vllm_wire import PromptJsonCache, without_prompt_echo

if TYPE_CHECKING:
    import aiohttp

    from polar_fast.config import EngineConfig, ModelConfig


class _LogprobsView(msgspec.Struct):
    token_logprobs: list[float | None] = []


class _CompletionChoice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _LogprobsView | None = None
    finish_reason: str | None = None


class _CompletionReply(msgspec.Struct):
    choices: list[_CompletionChoice]


class ChatReply(msgspec.Struct):
    """What `render = "engine"` needs from vLLM's chat reply."""

    prompt_ids: list[int]
    generation: Generation
    message: dict[str, Any]  # vLLM's parsed assistant message (content, reasoning, tool_calls)


_completion_decoder = msgspec.json.Decoder(_CompletionReply)


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
        )

    def _session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._http is None:
            # no timeout of its own (aiohttp's default is 5 min): _post bounds every call
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._http

    def rank_of(self, session_id: str) -> int:
        return zlib.crc32(session_id.encode()) % self._dp_size

    async def _post(self, path: str, body: dict[str, Any], *, session_id: str = "") -> bytes:
        headers = {"Content-Type": "application/json"}
        if self._dp_size > 1:
            headers["X-data-parallel-rank"] = str(self.rank_of(session_id))
        data = msgspec.json.encode(body)
        last = ""
        for attempt in range(self._max_retries + 1):
            if attempt:
                await asyncio.sleep(self._retry_delay_s * attempt)
            try:
                async with asyncio.timeout(self._timeout_s):
                    status, payload = await self._send(path, data, headers)
            except TimeoutError:
                raise EngineTimeout(f"vLLM {path} did not answer within {self._timeout_s} s") from None
            except OSError as e:  # refused, reset, unreadable reply (HttpError, aiohttp's errors)
                last = f"{type(e).__name__}: {e}"
                continue
            if status < 300:
                return payload
            last = f"HTTP {status}: {payload[:300].decode(errors='replace')}"
            if status < 500:
                raise EngineFailed(f"vLLM {path} refused the request: {last}")
        raise EngineUnavailable(f"vLLM at {self.url} unavailable after {self._max_retries + 1} tries: {last}")

    async def _send(self, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        if self._pool is not None:
            return await self._pool.post(path, data, headers)
        import aiohttp  # https: aiohttp's client

        try:
            async with self._session().post(self.url + path, data=data, headers=headers) as r:
                return r.status, await r.read()
        except aiohttp.ClientError as e:
            raise OSError(f"{type(e).__name__}: {e}") from None

    def _sampling_fields(self, sampling: Sampling) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return body

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = ""
    ) -> Generation:
        body = self._sampling_fields(sampling) | {"prompt": msgspec.Raw(self._prompt_json.json(session_id, prompt_ids)), "logprobs": 0}
        raw = await self._post("/v1/completions", body, session_id=session_id)
        try:
            choice = _completion_decoder.decode(without_prompt_echo(raw)).choices[0]
        except (msgspec.DecodeError, IndexError) as e:
            raise EngineFailed(f"vLLM sent an unreadable completion: {e}") from None
        ids = choice.token_ids or []
        logprobs = [lp if lp is not None else 0.0 for lp in (choice.logprobs.token_logprobs if choice.logprobs else [])]
        if len(logprobs) != len(ids):
            raise EngineFailed(f"vLLM returned {len(ids)} token ids but {len(logprobs)} logprobs")
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=_finish(choice.finish_reason))

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
        await self._post("/pause", {})
        try:
            await self._post("/collective_rpc", {"method": "reload_weights"})
            await self._post("/reset_prefix_cache", {})
        finally:
            await self._post("/resume", {})
        self.policy_version = version

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._http is not None:
            await self._http.close()
            self._http = None


def _finish(reason: str | None) -> str:
    # vLLM says "stop" for EOS and stop tokens, "length" at max_tokens, "abort" when cancelled.
    return reason if reason in ("stop", "length", "abort") else "stop"
