"""Sampling belongs to the run: what the engine is asked for, what is recorded, what training
refuses, and the importance ratio at a temperature other than 1 (embedded engine + learner, the
real SmolLM2 weights; test_vllm_real.py checks the same against a real vLLM)."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from polar_fast.config import parse_config
from polar_fast.engines import Sampling
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.records import CallRecord, HarnessSampling
from polar_fast.testing import scripted_proxy
from polar_fast.train import RunError, check_run

TOLERANCE = 1e-4


class SeenSampling(ScriptedEngine):
    """The scripted engine, noting the Sampling each call was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[Sampling] = []

    async def generate(self, prompt_ids, sampling, *, session_id=""):
        self.seen.append(sampling)
        return await super().generate(prompt_ids, sampling, session_id=session_id)


@pytest.mark.anyio
@pytest.mark.parametrize("from_harness", [False, True])
async def test_the_runs_sampling_wins_and_the_harness_ask_is_recorded(tmp_path, from_harness):
    engine = SeenSampling([[5, 6, 7]])
    config = {"sampling": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 12, "from_harness": from_harness}}
    body = {"model": "m", "temperature": 0.3, "top_p": 0.5, "max_tokens": 32000,  # as Claude Code asks
            "messages": [{"role": "user", "content": "hi"}]}
    async with scripted_proxy(tmp_path, engine=engine, config=config) as px, aiohttp.ClientSession() as http:
        async with http.post(f"{px.base_url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
        (record,) = await px.records()
    (sampling,) = engine.seen
    assert sampling.max_tokens == 12  # a hard cap, whatever the harness asks
    expected = (0.3, 0.5) if from_harness else (0.7, 1.0)
    assert (sampling.temperature, sampling.top_p) == expected
    assert record.temperature == expected[0]
    assert record.harness_sampling == HarnessSampling(temperature=0.3, top_p=0.5, max_tokens=32000)


@pytest.mark.anyio
async def test_a_seeded_run_gives_each_call_its_own_stable_seed(tmp_path):
    """sampling.seed set: the rollouts of a group see the same prompt, so one seed for all would
    make them sample alike (zero variance); each call's seed derives from its rollout and index."""
    from polar_fast.capture.sampling import call_seed

    engine = SeenSampling([[5, 6, 7]], cycle=True)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with scripted_proxy(tmp_path, engine=engine, config={"sampling": {"seed": 7}}) as px, \
            aiohttp.ClientSession() as http:
        other = await px.new_session("rollout-1", "group-0")
        for url in (px.base_url, px.base_url, px.base_url.replace(px.token, other)):
            async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
        async with http.post(f"{px.base_url}/v1/chat/completions", json={**body, "seed": 3}) as r:
            assert r.status == 200  # a harness that sends its own seed keeps it
    seeds = [s.seed for s in engine.seen]
    assert seeds == [call_seed(7, "rollout-0", 0), call_seed(7, "rollout-0", 1), call_seed(7, "rollout-1", 0), 3]
    assert len(set(seeds)) == 4 and call_seed(8, "rollout-0", 0) != seeds[0]


@pytest.mark.parametrize(("sampling", "message"), [
    ({"from_harness": True}, "from_harness"),
    ({"top_p": 0.9}, "top-p truncation"),
    ({"temperature": 0.0}, "temperature > 0"),
])
def test_training_refuses_sampling_the_learner_cannot_reproduce(sampling, message):
    with pytest.raises(RunError, match=message):
        check_run(parse_config({"sampling": sampling}))
    check_run(parse_config({"sampling": {"temperature": 0.7}}))  # any temperature > 0 is fine


def test_training_refuses_micro_batches_shorter_than_the_context():
    with pytest.raises(RunError, match="merge.max_tokens = 4096 is below model.max_context_tokens = 8192"):
        check_run(parse_config({"merge": {"max_tokens": 4096}}))


def _embedded_call(temperature: float) -> CallRecord:
    from polar_fast.engines.embedded import EmbeddedEngine
    from polar_fast.model import load_tokenizer

    cfg = parse_config({})
    engine = EmbeddedEngine(cfg.model, cfg.engine)
    tok = load_tokenizer("")
    text = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = list(tok.encode(text, add_special_tokens=False))
    gen = asyncio.run(engine.generate(prompt, Sampling(temperature=temperature, max_tokens=12, seed=3)))
    return CallRecord(session_id="s", rollout_id="r", group_id="g", call_index=0, prompt_ids=prompt,
                      completion_ids=gen.token_ids, completion_logprobs=gen.logprobs, policy_version=0,
                      finish_reason=gen.finish_reason, dialect="chat", temperature=temperature)


def _max_diff(call: CallRecord, learner_temperature: float) -> float:
    from polar_fast.grpo import Learner

    learner = Learner.from_config(parse_config({"sampling": {"temperature": learner_temperature}}))
    (logp,) = learner.logprobs([call])
    return float(np.abs(logp - np.asarray(call.completion_logprobs, np.float32)).max())


@pytest.mark.slow
def test_first_step_ratio_is_one_at_temperature_0_7():
    call = _embedded_call(0.7)
    assert _max_diff(call, 0.7) < TOLERANCE  # exp(learner - behaviour) == 1 within 1e-4 per token
    # either side ignoring the temperature breaks it: the learner at T=1 against T=0.7 logprobs,
    # which is also an engine recording T=1 logprobs against a learner at T=0.7
    assert _max_diff(call, 1.0) > TOLERANCE
