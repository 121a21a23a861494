"""An engine that returns chosen replies in order: the model's choices, scripted.

Replies are token id lists or texts; a text is tokenised with the given tokenizer and ends with
the tokenizer's end-of-turn token, as a model that stopped by itself would. Logprobs are
made-up but distinct per position (-0.01 * (i + 1)), so tests can tell them apart. Used by tests,
the proxy bench (`delay_s` gives it a fixed latency) and dry runs of a harness integration.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Iterable, Sequence

from polar_fast.engines import EngineUnavailable, Generation, Sampling

if TYPE_CHECKING:
    from polar_fast.config import EngineConfig, ModelConfig


def scripted_generation(ids: Sequence[int], sampling: Sampling) -> Generation:
    """A scripted reply as the engine returns it: cut at `sampling.max_tokens` (finish "length"),
    with made-up logprobs distinct per position."""
    ids, finish = list(ids), "stop"
    if len(ids) > sampling.max_tokens:
        ids, finish = ids[: sampling.max_tokens], "length"
    return Generation(token_ids=ids, logprobs=[-0.01 * (i + 1) for i in range(len(ids))], finish_reason=finish)


class ScriptedEngine:
    made_up_logprobs = True  # no policy computed them: a run on this engine has no mismatch gate (train.py)

    def __init__(
        self,
        replies: list[list[int]] | list[str],
        tokenizer=None,
        *,
        delay_s: float = 0.0,
        cycle: bool = False,
    ) -> None:
        self.policy_version = 0
        self._replies = [self._to_ids(r, tokenizer) for r in replies]
        self._next = 0
        self._delay_s = delay_s
        self._cycle = cycle
        self.prompts: list[list[int]] = []  # every prompt seen, in order (for tests)

    @classmethod
    def from_config(cls, model: ModelConfig, engine: EngineConfig) -> ScriptedEngine:
        from polar_fast.model import load_tokenizer

        return cls(list(engine.scripted_replies), load_tokenizer(model.path))

    @staticmethod
    def _to_ids(reply: list[int] | str, tokenizer) -> list[int]:
        if not isinstance(reply, str):
            return list(reply)
        if tokenizer is None:
            raise ValueError("ScriptedEngine: text replies need a tokenizer")
        return tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]

    def remaining(self) -> int:
        return len(self._replies) - self._next

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = ""
    ) -> Generation:
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        if self._next >= len(self._replies):
            if not self._cycle or not self._replies:
                raise EngineUnavailable(f"scripted engine has no reply left ({len(self._replies)} given)")
            self._next = 0
        ids = self._replies[self._next]
        self._next += 1
        self.prompts.append(prompt_ids)  # kept, not copied (~1e4 ids): a prompt is never mutated once made
        return scripted_generation(ids, sampling)

    async def update_weights(self, named_tensors: Iterable | None, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass


ENGINE_DOWN = "<engine down>"  # a PlaybookEngine reply that fails the call, as an engine outage would


class PlaybookEngine:
    """Scripted choices per task, for runs where many sessions share one engine (eval, warm-start
    demonstrations): a session's first prompt is decoded and matched against the plays' keys
    (e.g. each task's statement), and the session then gets that play's replies in order. A play
    is a list of alternatives; the n-th session of a play gets alternative n (cyclic), so a task
    run k times gets a known mix of good and bad samples whatever order the sessions start in.
    The reply ENGINE_DOWN raises EngineUnavailable on every call of its session."""

    made_up_logprobs = True

    def __init__(self, plays: dict[str, list[list[str]]], tokenizer) -> None:
        self.policy_version = 0
        self._tokenizer = tokenizer
        self._plays = {key: [[ScriptedEngine._to_ids(r, tokenizer) if r != ENGINE_DOWN else r for r in alt]
                             for alt in alts] for key, alts in plays.items()}
        self._started: dict[str, int] = dict.fromkeys(plays, 0)
        self._sessions: dict[str, tuple[list, int]] = {}  # session id -> (replies, next index)

    def _start(self, prompt_ids: Sequence[int]) -> list:
        text = self._tokenizer.decode(list(prompt_ids))
        for key, alternatives in self._plays.items():
            if key in text:
                n = self._started[key]
                self._started[key] += 1
                return alternatives[n % len(alternatives)]
        raise EngineUnavailable("playbook engine: the prompt matches no play")

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        replies, i = self._sessions.get(session_id) or (self._start(prompt_ids), 0)
        if i >= len(replies):
            raise EngineUnavailable(f"playbook engine: session {session_id} has no reply left")
        reply = replies[i]
        if reply == ENGINE_DOWN:
            self._sessions[session_id] = (replies, i)
            raise EngineUnavailable("playbook engine: engine down (scripted)")
        self._sessions[session_id] = (replies, i + 1)
        return scripted_generation(reply, sampling)

    async def update_weights(self, named_tensors: Iterable | None, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass
