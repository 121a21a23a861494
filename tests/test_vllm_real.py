"""The vLLM path against a real vLLM: the CPU build, one server per session (tests/vllm_server.py),
SmolLM2-135M-Instruct in float32. Nothing here is a fake. Generation on a shared 2-core CPU is
slow (~7 tokens/s), so completions stay short.

- token-in/token-out generation; recorded logprobs equal the learner's recomputation within 1e-4
  (fp32), at T=0.7 too, while perturbed weights or an ignored temperature exceed it;
- a weight sync with a call in flight: the call completes (vLLM's default pause mode aborts it),
  its record says at which token the version changed; a sync that changed the weights changes
  the logprobs, and restoring them restores the logprobs;
- `render = "engine"`: vLLM's own chat template and tool parser;
- one training step with `engine.kind = "vllm"`.
Tests that change the served weights put the original back, so test order does not matter.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
import torch
from harness_run import run_on_host
from safetensors.torch import load_file

# every import at the top: importing inside an async test reads files on the loop (blockbuster)
from polar_fast.config import parse_config
from polar_fast.engines import Sampling
from polar_fast.engines.vllm import VllmEngine
from polar_fast.learner.weight_sync import DiskSync
from polar_fast.model import load_tokenizer
from polar_fast.records import CallRecord
from polar_fast.rollouts.harnesses import ModelLimits, get_harness
from polar_fast.testing import scripted_proxy
from polar_fast.train import train

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(900)]

TOLERANCE = 1e-4  # |recorded - learner| per token, fp32 on both sides
COUNTING = "Count from 1 to 100, separated by commas."


def prompt_ids(text: str) -> list[int]:
    tok = load_tokenizer("")
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return list(tok.encode(rendered, add_special_tokens=False))


def engine_for(real_vllm) -> VllmEngine:
    return VllmEngine(real_vllm.url, model=real_vllm.cfg.model.name, timeout_s=600, sync_timeout_s=300)


def learner_for(temperature: float):
    from polar_fast.grpo import Learner

    cfg = parse_config({"sampling": {"temperature": temperature}})
    return Learner.from_config(cfg)


def call_of(prompt: list[int], gen) -> CallRecord:
    return CallRecord(session_id="s", rollout_id="r", group_id="g", call_index=0, prompt_ids=prompt,
                      completion_ids=gen.token_ids, completion_logprobs=gen.logprobs, policy_version=0,
                      finish_reason=gen.finish_reason, dialect="chat")


def max_diff(learner, call: CallRecord) -> float:
    (logp,) = learner.logprobs([call])
    return float(np.abs(logp - np.asarray(call.completion_logprobs, np.float32)).max())


async def test_token_in_token_out(real_vllm):
    engine = engine_for(real_vllm)
    prompt = await asyncio.to_thread(prompt_ids, "Say hello.")
    try:
        gen = await engine.generate(prompt, Sampling(max_tokens=8, temperature=1.0, seed=1), session_id="a")
        again = await engine.generate(prompt, Sampling(max_tokens=8, temperature=1.0, seed=1), session_id="a")
    finally:
        await engine.aclose()
    assert 1 <= len(gen.token_ids) <= 8 and len(gen.logprobs) == len(gen.token_ids)
    assert gen.finish_reason in ("stop", "length")
    assert all(lp <= 0 for lp in gen.logprobs)
    assert again.token_ids == gen.token_ids  # same seed, same tokens: ids went in and came out exact
    print(f"\nRESULT vllm_boot_s={real_vllm.boot_s:.0f}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_recorded_logprobs_equal_the_learners(real_vllm, temperature):
    engine = engine_for(real_vllm)
    prompt = await asyncio.to_thread(prompt_ids, "Write one sentence about the sea.")
    try:
        gen = await engine.generate(prompt, Sampling(max_tokens=16, temperature=temperature, seed=7), session_id="lp")
    finally:
        await engine.aclose()
    call = call_of(prompt, gen)
    learner = await asyncio.to_thread(learner_for, temperature)
    same = await asyncio.to_thread(max_diff, learner, call)
    # the first step's importance ratio, exp(learner - behaviour), is 1 within the tolerance
    assert same < TOLERANCE, f"T={temperature}: max |vllm - learner| = {same:.2e}"
    if temperature != 1.0:  # the learner ignoring the temperature is caught
        ignored = await asyncio.to_thread(max_diff, await asyncio.to_thread(learner_for, 1.0), call)
        assert ignored > TOLERANCE, f"T=1 learner vs T={temperature} sampling differ by only {ignored:.2e}"
    with torch.no_grad():  # negative control: the same learner with slightly different weights
        learner.policy.lm.model.norm.weight.mul_(1.01)
    perturbed = await asyncio.to_thread(max_diff, learner, call)
    assert perturbed > TOLERANCE, f"perturbed weights differ by only {perturbed:.2e}"
    print(f"\nRESULT temperature={temperature} n_tokens={len(gen.token_ids)} max_abs_diff={same:.3e} "
          f"perturbed_max_abs_diff={perturbed:.3e}")


async def running_requests(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


async def served_version(url: str) -> int:
    """The weight version label the server stamps now (0 before any sync set one)."""
    async with aiohttp.ClientSession() as http, http.get(url + "/weight_info") as r:
        label = (await r.json()).get("weight_version")
    return int(label) if isinstance(label, str) and label.isdigit() else 0


async def test_a_call_in_flight_across_a_weight_sync_completes(real_vllm, tmp_path):
    """The proxy's call is frozen by the sync (pause mode keep), not aborted, and its record says
    at which token the new version took over."""
    engine = engine_for(real_vllm)
    engine.policy_version = await served_version(real_vllm.url)  # earlier tests may have synced
    config = {"sampling": {"temperature": 0.0, "max_tokens": 16}, "model": {"max_context_tokens": 8192}}
    body = {"model": real_vllm.cfg.model.name, "messages": [{"role": "user", "content": COUNTING}]}
    version = engine.policy_version + 1
    try:
        async with scripted_proxy(tmp_path, engine=engine, config=config) as px, aiohttp.ClientSession() as http:
            async def chat() -> tuple[int, dict]:
                async with http.post(f"{px.base_url}/v1/chat/completions", json=body) as r:
                    return r.status, await r.json(content_type=None)

            call = asyncio.create_task(chat())
            while await running_requests(http, real_vllm.url) < 1:  # generating now
                await asyncio.sleep(0.05)
            started = time.perf_counter()
            await engine.update_weights(None, version=version)  # the same weights, reloaded
            sync_s = time.perf_counter() - started
            status, answer = await call
            assert status == 200, answer  # the old code's /pause (mode abort) failed it: 502
            (record,) = await px.records()
            assert (await chat())[0] == 200  # the next call is sampled by the new version alone
            records = await px.records()
    finally:
        await engine.aclose()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert len(record.completion_ids) == 16 and record.finish_reason == "length"
    assert record.policy_version == version - 1
    assert len(record.version_changes) == 1, record.version_changes
    (index, new), = record.version_changes
    assert new == version and 0 < index < 16  # mid-call, stamped on the token where it happened
    later = records[-1]
    assert later.policy_version == version and later.version_changes == []
    assert later.completion_ids[:index] == record.completion_ids[:index]  # greedy: same start
    print(f"\nRESULT keep_sync_s={sync_s:.2f} version_change_at_token={index}")


async def test_logprobs_follow_the_weights_a_disk_sync_loads(real_vllm):
    engine = engine_for(real_vllm)
    sync = DiskSync(engine, real_vllm.weights.parent)
    prompt = await asyncio.to_thread(prompt_ids, COUNTING)
    greedy = Sampling(max_tokens=8, temperature=0.0)
    original = await asyncio.to_thread(load_file, str(real_vllm.weights))
    perturbed = {k: (v * 1.01 if k == "model.norm.weight" else v) for k, v in original.items()}
    base = engine.policy_version = await served_version(real_vllm.url)
    try:
        before = await engine.generate(prompt, greedy)
        started = time.perf_counter()
        await sync.push(perturbed.items(), version=base + 1)
        sync_s = time.perf_counter() - started
        changed = await engine.generate(prompt, greedy)
        await sync.push(original.items(), version=base + 2)
        restored = await engine.generate(prompt, greedy)
    finally:
        await sync.push(original.items(), version=base + 3)  # idempotent; leaves the original served
        await engine.aclose()
    n = min(len(before.logprobs), len(changed.logprobs))
    moved = max(abs(a - b) for a, b in zip(before.logprobs[:n], changed.logprobs[:n]))
    assert moved > TOLERANCE, f"logprobs moved by only {moved:.2e} after new weights were loaded"
    assert restored.token_ids == before.token_ids
    assert max(abs(a - b) for a, b in zip(before.logprobs, restored.logprobs)) <= 1e-6
    size_mb = (await asyncio.to_thread(real_vllm.weights.stat)).st_size / 1e6
    print(f"\nRESULT disk_sync_s={sync_s:.2f} weights_mb={size_mb:.0f} logprob_moved={moved:.3e}")


async def test_engine_rendering_uses_vllms_template_and_tool_parser(real_vllm, tmp_path):
    engine = engine_for(real_vllm)
    config = {"engine": {"render": "engine"}, "sampling": {"temperature": 0.0, "max_tokens": 16}}
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                               "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
    body = {"model": real_vllm.cfg.model.name, "tools": tools,
            "messages": [{"role": "user", "content": "List the files here."}]}
    try:
        async with scripted_proxy(tmp_path, engine=engine, config=config) as px, aiohttp.ClientSession() as http:
            async with http.post(f"{px.base_url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            (record,) = await px.records()
    finally:
        await engine.aclose()
    tok = await asyncio.to_thread(load_tokenizer, "")
    own = tok.apply_chat_template(body["messages"], tools=tools, tokenize=False, add_generation_prompt=True)
    assert record.history == "render:engine"
    # vLLM rendered the model's own template (SmolLM2's shows no tool schemas), and answered a
    # request with tools at all only because the launcher passed --enable-auto-tool-choice and
    # the tool-call parser (without them vLLM refuses tool_choice "auto" with a 400)
    assert record.prompt_ids == list(tok.encode(own, add_special_tokens=False))
    assert 1 <= len(record.completion_ids) <= 16 and len(record.completion_logprobs) == len(record.completion_ids)
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and (message.get("content") or message.get("tool_calls"))


@pytest.mark.parametrize("name", ["mini-swe-agent", "pi"])
async def test_harness_end_to_end_through_the_proxy(real_vllm, name, bundles, dirs, tmp_path):
    """harness CLI -> proxy -> real vLLM; both first prompts fit the 8k context (Codex, Qwen Code
    and Claude Code send more). What the tiny model does with its turns is its own choice, so the
    checks are on the calls: answered, recorded token-exact, within the caps."""
    home, task = dirs
    engine = engine_for(real_vllm)
    config = {"sampling": {"max_tokens": 16}, "model": {"max_context_tokens": 8192}}
    try:
        async with scripted_proxy(tmp_path, engine=engine, config=config) as px:
            cmd = get_harness(name).command(
                prompt="Create the file hello.txt containing hi", proxy_url=px.base_url, api_key=px.token,
                model=real_vllm.cfg.model.name, home=str(home), bundle=str(bundles[name]), max_steps=2,
                limits=ModelLimits(context_tokens=8192, max_output_tokens=16))
            code, output = await run_on_host(cmd, home=home, cwd=task, timeout_s=600)
            records = await px.records()
            failures = px.proxy.state.sessions[px.token].engine_failures
    finally:
        await engine.aclose()
    where = f"{name} exited {code}; output:\n{output[-2000:]}"
    assert code != -1, where  # it ended by itself (step limit, answer or error), not by our timeout
    assert records, where
    assert failures == 0, where
    for r in records:
        assert len(r.prompt_ids) + len(r.completion_ids) <= 8192, where
        assert 1 <= len(r.completion_ids) <= 16 and len(r.completion_logprobs) == len(r.completion_ids), where
        assert r.finish_reason in ("stop", "length", "tool_calls") and r.temperature == 1.0, where
    print(f"\nRESULT harness={name} calls={len(records)} first_prompt_tokens={len(records[0].prompt_ids)}")


async def test_one_training_step_with_the_vllm_engine(real_vllm):
    """The run against the real server: rollouts, a GRPO step, the disk sync it reloads."""
    original = await asyncio.to_thread(load_file, str(real_vllm.weights))
    before = await served_version(real_vllm.url)
    cfg = parse_config({
        # the run's output dir is the served one: DiskSync writes <output_dir>/weights
        "run": {"output_dir": str(real_vllm.run_dir), "steps": 1, "groups_per_step": 1, "tensorboard": False,
                "zero_variance_skips": 0},  # the base model scores 0: train the first group as it comes
        "engine": {"kind": "vllm", "url": real_vllm.url, "timeout_s": 600},
        "sampling": {"max_tokens": 16},
        "harness": {"name": "mini-swe-agent", "max_steps": 2, "timeout_s": 600},
        "pools": {"group_size": 2, "agent_workers": 2, "boot_workers": 2, "eval_workers": 2, "prewarm": 0},
        "tasks": {"limit": 1},
    })
    engine = engine_for(real_vllm)
    try:
        summary = await train(cfg)
        after = await served_version(real_vllm.url)
    finally:  # the original weights served again for the other tests
        engine.policy_version = await served_version(real_vllm.url)
        await DiskSync(engine, real_vllm.weights.parent).push(original.items(), version=engine.policy_version)
        await engine.aclose()
    assert len(summary.steps) == 1 and summary.calls >= 2, summary
    assert summary.outcomes.get("infra_error", 0) == 0, summary.outcomes
    assert after == 1, (before, after)  # the step's sync labelled the new policy version 1
