"""End-to-end test helper: a real proxy on 127.0.0.1 with a scripted engine, for any test suite.

    async with scripted_proxy(tmp_path, write_file_replies("hello.txt", "hi")) as px:
        ... point a client at px.base_url (".../s/<token>", add "/v1" as the client needs)
        ... with px.token as its API key
        calls = await px.records()          # this session's CallRecords, via GET /sessions/...

The engine's replies are texts tokenised by the real SmolLM2 tokenizer (each ends with its
end-of-turn token, as a model that stopped would). `write_file_replies` scripts the usual
two-call run: a tool call that writes a file, then a final answer.

`groups_of(calls, rollouts)` turns made-up calls and rollout records (learner tests and benches)
into the GroupRecords the pools would have handed on.
"""

from __future__ import annotations

import json
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import msgspec

from polar_fast.config import Config, parse_config
from polar_fast.engines.scripted import ScriptedEngine
from polar_fast.proxy import Proxy, open_proxy
from polar_fast.records import CallRecord, RecordLog, RolloutRecord, read_log
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord
from polar_fast.rollouts.tasks import Task


def write_file_replies(
    path: str = "hello.txt",
    content: str = "hello from polar_fast",
    *,
    tool: str = "bash",
    argument: str = "command",
    final: str = "Done: the file is written.",
) -> list[str]:
    """Hermes-format tool call running `printf CONTENT > PATH`, then a plain final answer."""
    command = f"printf '%s' {json.dumps(content)} > {path}"
    call = json.dumps({"name": tool, "arguments": {argument: command}})
    return [f"<tool_call>\n{call}\n</tool_call>", final]


def stand_in_task(instance_id: str = "synthetic") -> Task:
    """A task for groups made up without one (the learner never reads it)."""
    return Task(instance_id=instance_id, repo="synthetic/synthetic", base_commit="0" * 40, problem_statement="",
                test_patch="", FAIL_TO_PASS=["synthetic"])


def groups_of(calls: list[CallRecord], rollouts: list[RolloutRecord]) -> list[GroupRecord]:
    """One GroupRecord per group id (in the order the rollouts name them), each rollout with its
    calls in the order given, as the pools hand a finished group on."""
    by_rollout: dict[str, list[CallRecord]] = {}
    for c in calls:
        by_rollout.setdefault(c.rollout_id, []).append(c)
    members: dict[str, list[FinishedRollout]] = {}
    for r in rollouts:
        members.setdefault(r.group_id, []).append(FinishedRollout(record=r, calls=by_rollout.get(r.rollout_id, [])))
    return [GroupRecord(group_id=g, task=stand_in_task(g), rollouts=m) for g, m in members.items()]


def renderer_with_template(tokenizer, template: str | None):
    """A Renderer for `tokenizer` with another chat template (None: the tokenizer's own)."""
    from polar_fast.capture.render import Renderer

    if template is None:
        return Renderer(tokenizer)

    class Tok:  # the real tokenizer with another chat template
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        chat_template = template

    return Renderer(Tok())


@dataclass(eq=False)
class ScriptedProxy:
    proxy: Proxy
    engine: ScriptedEngine
    token: str
    log_path: Path

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:PORT/s/<token> (no /v1), the harness adapters' `proxy_url`."""
        return f"{self.proxy.base_url}/s/{self.token}"

    @property
    def root_url(self) -> str:
        return self.proxy.base_url

    async def records(self, token: str | None = None) -> list[CallRecord]:
        """The session's records as the admin route returns them (real HTTP)."""
        url = f"{self.proxy.base_url}/sessions/{token or self.token}/records"
        async with aiohttp.ClientSession() as http, http.get(url, headers=self._admin()) as r:
            r.raise_for_status()
            return msgspec.json.decode(await r.read(), type=list[CallRecord])

    async def logged(self) -> list[CallRecord]:
        """Every call in the run's record log on disk (all sessions)."""
        import asyncio

        return (await asyncio.to_thread(read_log, self.log_path)).calls

    async def new_session(self, rollout_id: str = "", group_id: str = "") -> str:
        url = f"{self.proxy.base_url}/sessions"
        body = {"rollout_id": rollout_id, "group_id": group_id}
        async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=self._admin()) as r:
            r.raise_for_status()
            return (await r.json())["token"]

    def _admin(self) -> dict[str, str]:
        key = self.proxy.admin_key
        return {"x-admin-key": key} if key else {}


@asynccontextmanager
async def scripted_proxy(
    tmp_path: str | os.PathLike[str],
    replies: list[str] | list[list[int]] | None = None,
    *,
    unix_socket: str = "",
    config: dict | None = None,
    cycle: bool = False,
    engine=None,
) -> AsyncIterator[ScriptedProxy]:
    """A real proxy (aiohttp on 127.0.0.1:0, optional unix socket) with one session open.

    `config` holds section overrides ({"proxy": {"history": "template"}}); `engine` replaces the
    scripted engine (e.g. a failing one); `px.engine` is whichever engine serves."""
    import asyncio

    from polar_fast.model import load_tokenizer

    raw = {"engine": {"kind": "scripted"}, "proxy": {"unix_socket": unix_socket}}
    for section, values in (config or {}).items():
        raw.setdefault(section, {}).update(values)
    cfg: Config = parse_config(raw)
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.path)
    if engine is None:
        engine = ScriptedEngine(replies if replies is not None else write_file_replies(), tokenizer, cycle=cycle)
    log_path = Path(tmp_path) / "calls.log"
    record_log = await asyncio.to_thread(RecordLog, log_path)  # file I/O stays off the loop
    try:
        async with open_proxy(cfg, engine, record_log) as proxy:
            scripted = ScriptedProxy(proxy, engine, "", log_path)
            scripted.token = await scripted.new_session("rollout-0", "group-0")
            yield scripted
    finally:
        await asyncio.to_thread(record_log.close)
