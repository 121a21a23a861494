"""Claude Code, Codex, Qwen Code and Pi compact their own context when told the served limits.

Each real CLI runs through its adapter's command against `scripted_proxy` whose context
(`model.max_context_tokens`) sits a few tool results above the CLI's first prompt, and the
adapter is given the same limits. The scripted engine (the model's choices: a test double) calls
the harness's shell tool to print ~3k tokens per step, so the conversation grows until the
harness, on its own, sends its summary request (found by its own summary prompt in the last user
turn). That request gets a summary; the first prompt after it holds the summary, and the engine
then ends the run. We assert:

- the harness's summary request was seen, and the proxy refused no call for its length (the
  harness compacted before a call would overflow). Pi checks its threshold only between prompts,
  so inside one `pi -p` run it compacts on the proxy's context-length error: for Pi each refusal
  must be a 400 answered straight away by Pi's summary request (the error has the shape Pi
  reads as an overflow);
- the next prompt after the summary is shorter than the last main-loop prompt before it;
- the merge of the session's records counts the break (`in_prompt`, the cause compaction makes).
A second test tells Claude Code and Qwen Code three times the served context, so they overflow:
the proxy's context-length error must make them compact and retry, with the same checks.
mini-swe-agent never compacts, so it is not here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
from harness_run import run_on_host
from test_harness_proxy import MODEL, TOOLS, front, hermes

from polar_fast.engines import Generation, Sampling
from polar_fast.engines.scripted import ScriptedEngine, scripted_generation
from polar_fast.merge import merge
from polar_fast.model import load_tokenizer
from polar_fast.rollouts.harnesses import ModelLimits, get_harness
from polar_fast.testing import scripted_proxy

SUMMARY_MARK = "POLAR-SUMMARY"
# Texts of each harness's own summary requests, read in its bundled source.
SUMMARY_PROMPTS = {
    "claude-code": ("Your task is to create a detailed summary of the conversation so far",),
    "codex": ("CONTEXT CHECKPOINT COMPACTION",),
    "qwen-code": ("produce the <state_snapshot> XML",),
    # Pi summarises the history before the kept part, and a kept turn's cut-off prefix apart
    "pi": ("Create a structured context checkpoint summary", "This is the PREFIX of a turn that was too large"),
}
# The served context per harness: its first prompt (system prompt + tool schemas, in SmolLM2
# tokens) plus a few steps of PAD_LINES, so compaction is due after 2-4 steps.
CONTEXT_TOKENS = {"claude-code": 48_000, "codex": 30_000, "qwen-code": 30_000, "pi": 16_000}
# Harnesses that check their threshold only between prompts: within one run they compact when the
# proxy's context-length error says the prompt overflowed, then retry (the error's shape is what
# this checks for them).
REACTIVE = {"pi": "Pi checks its threshold when an agent run ends or a prompt starts; inside one `pi -p` "
                  "run it compacts on the provider's context-overflow error and retries"}
MAX_OUTPUT_TOKENS = 1024
PAD_LINES = 180  # ~3k tokens of tool output per step
MAX_STEPS = 14  # padding steps before the engine gives up waiting for a compaction
RUN_TIMEOUT_S = 240.0
USER_TURN = "<|im_start|>user\n"


def summary_reply() -> str:
    # <summary> for Claude Code, a closed <state_snapshot> for Qwen Code; plain text elsewhere.
    return (f"<summary>\n<state_snapshot>\n{SUMMARY_MARK}: printed padding to fill the context; "
            "nothing is left to do.\n</state_snapshot>\n</summary>")


def pad_command(step: int) -> str:
    return (f"for i in $(seq 1 {PAD_LINES}); do echo \"step {step} line $i: the quick brown fox jumps "
            "over the lazy dog\"; done")


class GrowingEngine:
    """Scripted engine (a test double for the model): pads the context through the shell tool
    until the harness asks for a summary, answers it, then ends the run once the summary is in
    the prompt. Replies are picked by the prompt, so side calls a CLI makes are answered too."""

    def __init__(self, tokenizer, name: str) -> None:
        self.policy_version = 0
        self.tokenizer = tokenizer
        self.name = name
        self.prompts: list[tuple[str, int]] = []  # (kind, prompt tokens) per call, in order

    def _reply(self, text: str) -> tuple[str, str]:
        last_user = text[text.rfind(USER_TURN):] if USER_TURN in text else text
        if any(p in last_user for p in SUMMARY_PROMPTS[self.name]):
            return "summary", summary_reply()
        if SUMMARY_MARK in text:
            return "after", "Done: the work is summarised and finished."
        steps = text.count(f"{USER_TURN}<tool_response>")
        if steps >= MAX_STEPS:
            return "main", "Done without a compaction."
        return "main", hermes(TOOLS[self.name].shell(pad_command(steps)), text="Printing more.")

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        text = await asyncio.to_thread(self.tokenizer.decode, list(prompt_ids))
        kind, reply = self._reply(text)
        self.prompts.append((kind, len(prompt_ids)))
        return scripted_generation(ScriptedEngine._to_ids(reply, self.tokenizer), sampling)

    async def update_weights(self, named_tensors, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass


async def run_growing(name: str, bundle: Path, home: Path, task: Path, tmp_path: Path, *,
                      told_context: int) -> None:
    """Run `name` against a proxy serving CONTEXT_TOKENS[name] with its adapter told
    `told_context`, and check the compaction; `reactive`: it compacts on the proxy's error."""
    context = CONTEXT_TOKENS[name]
    reactive = name in REACTIVE or told_context > context
    tokenizer = await asyncio.to_thread(load_tokenizer, "")
    engine = GrowingEngine(tokenizer, name)
    config = {"model": {"max_context_tokens": context}, "sampling": {"max_tokens": MAX_OUTPUT_TOKENS}}
    limits = ModelLimits(context_tokens=told_context, max_output_tokens=MAX_OUTPUT_TOKENS)
    async with scripted_proxy(tmp_path, engine=engine, config=config) as px:
        async with front(px.root_url) as fr:
            cmd = get_harness(name).command(
                prompt="Print padding with the shell tool until you are told to stop.",
                proxy_url=f"{fr.url}/s/{px.token}", api_key=px.token, model=MODEL, home=str(home),
                bundle=str(bundle), max_steps=MAX_STEPS + 6, limits=limits)
            code, output = await run_on_host(cmd, home=home, cwd=task, timeout_s=RUN_TIMEOUT_S)
        records = await px.records()
    calls = fr.model_calls()
    refused = [i for i, s in enumerate(calls) if s.status != 200]
    where = (f"{name} exited {code}; context {context}, told {told_context}; calls (kind, prompt tokens): "
             f"{engine.prompts}; refused: {[calls[i].status for i in refused]}; output:\n{output[-2500:]}")
    kinds = [k for k, _ in engine.prompts]
    assert "summary" in kinds, f"the harness never sent its summary request; {where}"
    if reactive:  # each refusal is a 400 the harness answers with its summary request
        assert refused, f"expected the overflow path; {where}"
        for i in refused:
            assert calls[i].status == 400 and i + 1 < len(calls), where
            assert any(p in calls[i + 1].body.decode() for p in SUMMARY_PROMPTS[name]), where
    else:
        assert not refused, f"the proxy refused calls (a call overflowed before compaction); {where}"
    first_summary = kinds.index("summary")
    after = [n for k, n in engine.prompts[first_summary + 1:] if k != "summary"]
    assert after, f"no call after the summary request; {where}"
    before = [n for k, n in engine.prompts[:first_summary] if k == "main"]
    assert after[0] < before[-1], f"the next prompt is not shorter than the last one before; {where}"
    assert code == 0, where
    stats = merge(records).stats
    assert stats.n_calls == len(records) == len(engine.prompts), where
    assert stats.in_prompt >= 1, f"merge counted no in-prompt break: {stats}; {where}"


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", sorted(SUMMARY_PROMPTS))
async def test_harness_compacts_before_the_context_overflows(name, bundles, dirs, tmp_path):
    home, task = dirs
    await run_growing(name, bundles[name], home, task, tmp_path, told_context=CONTEXT_TOKENS[name])


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", ["claude-code", "qwen-code"])
async def test_proxy_context_error_makes_the_harness_compact_and_retry(name, bundles, dirs, tmp_path):
    """The fallback when a harness's window is set too high (a floor, a stale setting): told 3x
    the served context, the harness overflows, and the proxy's context-length error must have
    the shape this harness answers by compacting and retrying (Pi takes this path in the test
    above; Codex stops on any context error). Claude Code needs Anthropic's text ("prompt is too
    long: N tokens > M maximum"): with the proxy's earlier wording it stopped after six 400s.
    Qwen Code also reads the OpenAI error code `context_length_exceeded`."""
    home, task = dirs
    await run_growing(name, bundles[name], home, task, tmp_path, told_context=3 * CONTEXT_TOKENS[name])
