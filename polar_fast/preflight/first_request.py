"""A harness's first request in the run's model tokens, measured by running it.

The real CLI, from its cached bundle (built as the run would build it), runs once in a local
sandbox against the real capture proxy, which renders what it sends with the model's own chat
template and tools, exactly as in training. A scripted engine answers every call with "Done."
and records each prompt's length; the harness gets one turn (`harness.max_steps = 1`). The
first request is the longest prompt of that turn (a CLI's side calls, such as a title, are
shorter than its main request, which holds the system prompt and every tool schema).

The proxy is told a context far above any prompt, so it never refuses the request being
measured; the task prompt is the first training task's statement, and the working directory is
empty (a harness that lists the repo in its prompt lists nothing).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Sequence

import msgspec

from polar_fast.config import Config
from polar_fast.engines import Generation, Sampling
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.errors import PolarError
from polar_fast.rollouts.tasks import Task

MEASURE_CONTEXT = 1_000_000  # what the proxy is told while measuring: no prompt is refused
REPLY = "Done."
RUN_TIMEOUT_S = 240.0


class MeasureError(PolarError):
    """The harness made no model call to measure; the message carries the end of its output."""


class _Recorder:
    """Answers "Done." to every call and keeps each prompt's length."""

    def __init__(self, tokenizer) -> None:
        self.policy_version = 0
        self.prompts: list[int] = []
        self.called = asyncio.Event()
        self._replies = ScriptedEngine([REPLY] * 64, tokenizer)

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        self.prompts.append(len(prompt_ids))
        self.called.set()
        return await self._replies.generate(prompt_ids, sampling, session_id=session_id)

    async def update_weights(self, named_tensors, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass


def measuring_config(cfg: Config, harness: str) -> Config:
    """`cfg` as the measurement runs it: this harness, one turn, a local sandbox, no refusals."""
    s = msgspec.structs.replace
    return s(cfg, harness=s(cfg.harness, name=harness, max_steps=1),
             sandbox=s(cfg.sandbox, kind="local"), engine=s(cfg.engine, kind="scripted"),
             model=s(cfg.model, max_context_tokens=MEASURE_CONTEXT), proxy=s(cfg.proxy, port=0, unix_socket=""))


async def measure_first_request(cfg: Config, harness: str, prompt: str) -> int:
    """Tokens of `harness`'s first request for a task stated as `prompt` (module docstring)."""
    from polar_fast.model import load_tokenizer
    from polar_fast.rollouts.stack import open_rollouts

    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.path)
    engine = _Recorder(tokenizer)
    task = Task(instance_id="preflight", repo="preflight/preflight", base_commit="0" * 40,
                problem_statement=prompt, test_patch="", FAIL_TO_PASS=["preflight"])
    with tempfile.TemporaryDirectory(prefix="polar-check-") as work:
        async with open_rollouts(measuring_config(cfg, harness), Path(work), engine=engine) as rollouts:
            async with rollouts.factory.open(rollouts.agent.spec(task, "preflight")) as box:
                result = await rollouts.agent.run(box, task, rollout_id="preflight", group_id="preflight",
                                                  timeout_s=RUN_TIMEOUT_S, calls=[])
    if not engine.prompts:
        raise MeasureError(f"{harness} made no model call (exit {result.exit_code}"
                           f"{', timed out' if result.timed_out else ''}): {result.output_tail[-600:].strip()}")
    return max(engine.prompts)
