"""One engine over several running `vllm serve` replicas (`engine.urls`), each a VllmEngine client.

- Routing: a session stays on one replica for its whole life, so its growing prompts hit that
  replica's prefix cache. The replica is the live one ranking highest for the session under
  rendezvous hashing (blake2b of url and session id): no table to grow with the sessions, the
  same choice on every rollout node, and when a replica is taken out only its own sessions move.
  Calls without a session id have no prefix to reuse and go round-robin.
- Failure: a call that gets EngineUnavailable (refused or 5xx after `engine.max_retries`) takes
  its replica out of routing for the rest of the run and fails as an engine failure (the proxy
  answers 503, the harness sees an engine failure); the session's next call goes to the next
  replica of its ranking. Other sessions never notice. Timeouts and refused requests (4xx) leave
  the replica in. With none left, every call is an EngineUnavailable naming each replica's fault.
- Versions: each call's version is what its replica's reply says (VllmEngine reads vLLM's
  `weight_versions` spans), so a replica that lags a sync is recorded as lagging.
- `update_weights(None, version)` reloads every live replica at once (each pauses, reloads,
  resets its prefix cache, labels the version and resumes, as a single VllmEngine does). A
  replica that cannot be reached is taken out and the sync goes on without it; any other
  failure is a WeightSyncError naming the replica, as for one engine.
- Weight transfer over NCCL (`VllmTransferSync`) needs one engine; the config refuses
  `weight_sync = "transfer"` with several replicas.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import msgspec

from polar_fast.engines import EngineUnavailable, Generation, Sampling
from polar_fast.engines.vllm import ChatReply, VllmEngine
from polar_fast.errors import WeightSyncError

if TYPE_CHECKING:
    from polar_fast.config import EngineConfig, ModelConfig


class ReplicatedEngine:
    def __init__(self, replicas: Sequence[VllmEngine]) -> None:
        if not replicas:
            raise EngineUnavailable("engine.urls is empty: list the running `vllm serve` replicas")
        urls = [r.url for r in replicas]
        if len(set(urls)) != len(urls):
            raise EngineUnavailable(f"engine.urls lists a server twice: {urls}")
        self.replicas = list(replicas)
        self.policy_version = 0
        self.lost: dict[str, str] = {}  # url -> why it was taken out of routing
        self._live = list(self.replicas)
        self._round_robin = itertools.count()

    @classmethod
    def from_config(cls, model: ModelConfig, engine: EngineConfig) -> ReplicatedEngine:
        return cls([VllmEngine.from_config(model, msgspec.structs.replace(engine, url=url, urls=[]))
                    for url in engine.urls])

    def replica_for(self, session_id: str) -> VllmEngine:
        """The live replica a call of `session_id` goes to (module docstring)."""
        if not self._live:
            faults = "; ".join(f"{url}: {why}" for url, why in self.lost.items())
            raise EngineUnavailable(f"no engine replica is left, all {len(self.replicas)} were taken out: {faults}")
        if not session_id:
            return self._live[next(self._round_robin) % len(self._live)]
        return max(self._live, key=lambda r: _rank(r.url, session_id))

    def take_out(self, replica: VllmEngine, why: str) -> None:
        if replica in self._live:
            self._live.remove(replica)
            self.lost[replica.url] = why

    async def _routed(self, session_id: str, call: str, *args: Any) -> Any:
        replica = self.replica_for(session_id)
        try:
            return await getattr(replica, call)(*args, session_id=session_id)
        except EngineUnavailable as e:
            self.take_out(replica, str(e))
            raise EngineUnavailable(f"{e}; replica taken out of routing ({len(self._live)} of "
                                    f"{len(self.replicas)} left), the session's next call goes to another") from e

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        return await self._routed(session_id, "generate", prompt_ids, sampling)

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *,
                   session_id: str = "") -> ChatReply:
        return await self._routed(session_id, "chat", messages, tools, sampling)

    async def update_weights(self, named_tensors: Iterable | None, *, version: int) -> None:
        if named_tensors is not None:
            raise NotImplementedError("vllm replicas reload from disk: pass None")
        live = list(self._live)
        results = await asyncio.gather(*(r.update_weights(None, version=version) for r in live), return_exceptions=True)
        failed = []
        for replica, result in zip(live, results):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # cancelled: not a replica's fault
            if isinstance(result, BaseException) and _unreachable(result):
                self.take_out(replica, f"unreachable at the sync to version {version}: {result}")
            elif isinstance(result, BaseException):
                failed.append((replica, result))
        if failed:
            raise WeightSyncError("; ".join(f"replica {r.url}: {e}" for r, e in failed)) from failed[0][1]
        if not self._live:
            raise WeightSyncError(f"weight sync to version {version}: no engine replica is left "
                                  f"({'; '.join(f'{u}: {w}' for u, w in self.lost.items())})")
        self.policy_version = version

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.aclose()


def _rank(url: str, session_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{url}\0{session_id}".encode(), digest_size=8).digest(), "big")


def _unreachable(error: BaseException) -> bool:
    """Whether a failed sync came from a replica that does not answer: VllmEngine.control turns
    EngineUnavailable into WeightSyncError, which keeps it as its context."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, EngineUnavailable):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
