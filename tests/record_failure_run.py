"""Run by test_proxy.py in a child process (a file size limit is per process): a session's
second call meets a record log that cannot grow (RLIMIT_FSIZE, a real short write), then the
same call again once it can. Prints what the test asserts on, as JSON."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys

import aiohttp

from polar_fast.records import read_log
from polar_fast.testing import scripted_proxy, write_file_replies


async def main(tmp: str) -> dict:
    call, final = write_file_replies("hello.txt", "hi")
    async with scripted_proxy(tmp, [call, final, final]) as px, aiohttp.ClientSession() as http:
        url = px.base_url + "/v1/chat/completions"
        first = {"model": "m", "messages": [{"role": "user", "content": "write hello.txt"}],
                 "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]}
        async with http.post(url, json=first) as r:
            assert r.status == 200, await r.text()
            message = (await r.json())["choices"][0]["message"]
        tool_call = message["tool_calls"][0]
        second = dict(first, messages=first["messages"] + [
            {"role": "assistant", "content": None, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": tool_call["id"], "content": "ok"},
        ])
        size_before = os.path.getsize(px.log_path)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size_before + 16, hard))  # room for 16 bytes only
        try:
            async with http.post(url, json=second) as r:
                failed = {"status": r.status, "body": await r.json()}
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        size_after_failure = os.path.getsize(px.log_path)
        async with http.get(px.root_url + "/") as r:
            alive = r.status
        async with http.post(url, json=second) as r:
            retried = r.status
        served = await px.records()
    contents = read_log(px.log_path)
    return {
        "failed": failed,
        "size_before": size_before,
        "size_after_failure": size_after_failure,
        "alive": alive,
        "retried": retried,
        "served": [[c.call_index, c.history, c.prompt_ids, c.completion_ids] for c in served],
        "logged": [[c.call_index, c.history, c.prompt_ids, c.completion_ids] for c in contents.calls],
        "logged_exchanges": [len(e.messages) for e in contents.exchanges],
        "torn_bytes": contents.torn_bytes,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
