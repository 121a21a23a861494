"""Each real harness CLI, run on this host through its adapter's command against a loopback fake
model server speaking its dialect: the request must carry the session token and model name, and
the CLI must exit 0 having printed the answer, and the output cap its adapter was given
(`ModelLimits.max_output_tokens`) must be the cap its requests carry."""

from __future__ import annotations

import secrets

import pytest
from harness_run import run_on_host
from harness_servers import FakeModel, serve

from polar_fast.rollouts.harnesses import ModelLimits, get_harness

MODEL = "polar-test-model"
LIMITS = ModelLimits(context_tokens=32768, max_output_tokens=1024)
# harness -> the API path its requests use
DIALECT_PATH = {
    "codex": "/v1/responses",
    "claude-code": "/v1/messages",
    "qwen-code": "/v1/chat/completions",
    "pi": "/v1/chat/completions",
    "mini-swe-agent": "/v1/chat/completions",
}


NO_OUTPUT_CAP = {"codex": "Codex CLI has no output-cap setting and sends no max_output_tokens"}


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(DIALECT_PATH))
async def test_harness_answers_through_proxy_session(name, bundles, dirs):
    token = secrets.token_hex(8)
    fake = FakeModel(answer=f"ANSWER-{secrets.token_hex(4)}")
    home, task = dirs
    async with serve(fake) as url:
        cmd = get_harness(name).command(
            prompt="Say the answer.", proxy_url=f"{url}/s/{token}", api_key=token, model=MODEL,
            home=str(home), bundle=str(bundles[name]), max_steps=5, limits=LIMITS)
        code, output = await run_on_host(cmd, home=home, cwd=task)
    calls = fake.model_requests()
    assert calls, f"{name} sent no model request; output:\n{output[-3000:]}"
    for call in calls:
        assert call.path == f"/s/{token}{DIALECT_PATH[name]}", call.path
        assert token in (call.headers.get("Authorization", "") + call.headers.get("x-api-key", ""))
        assert call.body["model"] == MODEL
    assert code == 0, f"{name} exited {code}; output:\n{output[-3000:]}"
    if name not in NO_OUTPUT_CAP:  # the adapter's output cap reached the wire
        caps = [c.body.get("max_tokens", c.body.get("max_completion_tokens")) for c in calls]
        assert LIMITS.max_output_tokens in caps and all(c is not None and c <= LIMITS.max_output_tokens
                                                        for c in caps), caps
    assert fake.answer in output, output[-3000:]
