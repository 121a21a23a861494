"""The official Python SDKs (openai, anthropic) against the real proxy: they must parse every reply
and stream we send, and a two-call tool run must give a token-exact second prompt. Also the
embedded SmolLM2 engine answering through the proxy, its logprobs checked by a separate forward
pass."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
import torch

from polar_fast.config import parse_config
from polar_fast.engines.embedded import EmbeddedEngine
from polar_fast.model import load_model
from polar_fast.testing import scripted_proxy, write_file_replies

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


async def _client(kind: str, **kwargs):
    # SDK clients read CA bundles when built: build them off the event loop.
    if kind == "openai":
        return await asyncio.to_thread(openai.AsyncOpenAI, max_retries=0, **kwargs)
    return await asyncio.to_thread(anthropic.AsyncAnthropic, max_retries=0, **kwargs)


def assert_exact(calls) -> None:
    assert [c.history for c in calls] == ["render:first_call", "exact"]
    joined = calls[0].prompt_ids + calls[0].completion_ids
    assert calls[1].prompt_ids[: len(joined)] == joined


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_openai_chat_sdk(tmp_path, stream):
    async with scripted_proxy(tmp_path, write_file_replies()) as px:
        client = await _client("openai", base_url=px.base_url + "/v1", api_key=px.token)
        tools = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": SCHEMA}}]
        messages = [{"role": "user", "content": "write hello.txt"}]
        if stream:
            chunks = [c async for c in await client.chat.completions.create(model="m", messages=messages, tools=tools, stream=True, stream_options={"include_usage": True})]
            calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            call_id, name, args = calls[0].id, calls[0].function.name, "".join(tc.function.arguments or "" for tc in calls)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
            assert chunks[-1].usage.prompt_tokens > 0
        else:
            reply = await client.chat.completions.create(model="m", messages=messages, tools=tools)
            tc = reply.choices[0].message.tool_calls[0]
            call_id, name, args = tc.id, tc.function.name, tc.function.arguments
            assert reply.choices[0].finish_reason == "tool_calls"
        assert name == "bash" and "hello.txt" in json.loads(args)["command"]
        messages += [
            {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": call_id, "content": [{"type": "text", "text": ""}]},
        ]
        if stream:
            text = "".join([c.choices[0].delta.content or "" async for c in await client.chat.completions.create(model="m", messages=messages, tools=tools, stream=True) if c.choices])
        else:
            text = (await client.chat.completions.create(model="m", messages=messages, tools=tools)).choices[0].message.content
        assert text == "Done: the file is written."
        models = await client.models.list()
        assert [m.id for m in models.data] == ["smollm2-135m-instruct"]
        await client.close()
        assert_exact(await px.records())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_openai_responses_sdk(tmp_path, stream):
    async with scripted_proxy(tmp_path, write_file_replies()) as px:
        client = await _client("openai", base_url=px.base_url + "/v1", api_key=px.token)
        tools = [{"type": "function", "name": "bash", "description": "run", "parameters": SCHEMA, "strict": False}]
        items = [{"role": "user", "content": "write hello.txt"}]

        async def create(input_items):
            if not stream:
                return await client.responses.create(model="m", input=input_items, tools=tools, instructions="Be brief.")
            events = [e async for e in await client.responses.create(model="m", input=input_items, tools=tools, instructions="Be brief.", stream=True)]
            types = [e.type for e in events]
            assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
            assert [e.sequence_number for e in events] == list(range(len(events)))
            done = [e.item for e in events if e.type == "response.output_item.done"]
            assert [o.id for o in events[-1].response.output] == [o.id for o in done]
            return events[-1].response

        first = await create(items)
        call = [o for o in first.output if o.type == "function_call"][0]
        assert call.name == "bash" and first.status == "completed"
        items += [
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "ok"},
        ]
        second = await create(items)
        assert second.output_text == "Done: the file is written."
        await client.close()
        assert_exact(await px.records())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_anthropic_sdk(tmp_path, stream):
    async with scripted_proxy(tmp_path, write_file_replies()) as px:
        client = await _client("anthropic", base_url=px.base_url, api_key=px.token)
        tools = [{"name": "bash", "description": "run", "input_schema": SCHEMA}]
        messages = [{"role": "user", "content": "write hello.txt"}]

        async def create(msgs):
            if not stream:
                return await client.messages.create(model="m", max_tokens=256, system="Be brief.", messages=msgs, tools=tools)
            async with client.messages.stream(model="m", max_tokens=256, system="Be brief.", messages=msgs, tools=tools) as s:
                return await s.get_final_message()

        first = await create(messages)
        use = [b for b in first.content if b.type == "tool_use"][0]
        assert first.stop_reason == "tool_use" and use.name == "bash" and "hello.txt" in use.input["command"]
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "ok"}]},
        ]
        second = await create(messages)
        assert second.content[0].text == "Done: the file is written." and second.stop_reason == "end_turn"
        count = await client.messages.count_tokens(model="m", messages=messages, tools=tools)
        assert count.input_tokens > 0
        await client.close()
        assert_exact(await px.records())


async def test_sdk_errors_are_typed(tmp_path):
    async with scripted_proxy(tmp_path, ["x"]) as px:
        oc = await _client("openai", base_url=px.root_url + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            await oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await oc.close()
        ac = await _client("anthropic", base_url=px.root_url, api_key="wrong")
        with pytest.raises(anthropic.AuthenticationError):
            await ac.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        await ac.close()


@pytest.mark.timeout(300)
async def test_embedded_engine_logprobs_match_forward_pass(tmp_path):
    cfg = parse_config({})
    engine = await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)
    async with scripted_proxy(tmp_path, engine=engine) as px:
        client = await _client("openai", base_url=px.base_url + "/v1", api_key=px.token)
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, seed=0
        )
        await client.close()
        (call,) = await px.records()
    assert reply.usage.completion_tokens == len(call.completion_ids) <= 16
    reference = await asyncio.to_thread(load_model, "")
    ids = torch.tensor([call.prompt_ids + call.completion_ids])
    with torch.inference_mode():
        logits = reference(input_ids=ids).logits[0].float()  # (T, V)
    n = len(call.prompt_ids)
    logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
    expected = logp.gather(1, torch.tensor(call.completion_ids)[:, None])[:, 0]
    # fp32: a cached decode step and one whole forward sum in different orders (~1e-5 apart on
    # torch 2.15's CPU kernels); a wrong position, temperature or token is off by far more
    torch.testing.assert_close(torch.tensor(call.completion_logprobs), expected, atol=1e-4, rtol=0)
