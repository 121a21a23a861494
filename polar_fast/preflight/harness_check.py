"""`python -m polar_fast harnesses check NAME|FILE [--config run.toml] [--json PATH]`: does a
harness train exactly? Answered by running it, before anyone spends GPU hours on it.

The harness (built-in, declared in the run's [harness], or declared in FILE) runs once on a
tiny built-in task, through the same bundle install, sandbox, pools and capture proxy as
training, with a scripted engine in place of the model. The engine walks it through a fixed
script, picking its step by how many tool results the prompt holds (so a CLI's side calls, such
as a title, get an answer too), and finds the harness's shell tool in the tool schemas the
proxy rendered into the prompt:

1. reasoning, a sentence, and a shell call `echo polar-check-$((6*7))`: only a run command
   prints `polar-check-42`, so seeing it in a later prompt proves the tool call round-tripped;
2. a second shell call that applies the task's fix;
3. the end of the task: the harness's `end_command` through the shell tool where it has one
   (mini-swe-agent's submit), else a plain final answer.

The lines, each pass, fail or n/a with its evidence (preflight.Item):
- proxy: it reached the proxy; which dialect, streamed or not;
- context: compaction (harnesses with a threshold: a second run with a window just above its
  first request and a step-1 reply that fills it; it must send a prompt that no longer holds
  the whole conversation); n/a for a harness that never compacts;
- tool call: recognised and run, its output back in the next request;
- history: every continuation came back token-exact (the proxy reused the sampled ids). If not:
  the first differing token, what the harness changed in the reply it resent (reasoning dropped,
  tool call rewritten, whitespace, text), and the cost (the merge's breaks and the sampled tokens
  that then come back only as prompt);
- end: the harness ended by itself (exit 0) and the rollout was scored.
The check runs with `proxy.history` as configured (exact by default), on a local sandbox unless
the config says docker, and tells the proxy the model takes a million tokens (a CLI's system
prompt and tool schemas outgrow a small model's window; the scripted engine has none).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import msgspec

from polar_fast.config import Config
from polar_fast.engines import Generation, Sampling
from polar_fast.preflight import Item, failed, not_applicable, passed
from polar_fast.records import CallRecord, ExchangeRecord, Outcome, RolloutRecord

AREA = "harness"
MARK_COMMAND = "echo polar-check-$((6*7))"
MARK_OUTPUT = "polar-check-42"  # only running MARK_COMMAND prints this
CHECK_CONTEXT = 1_000_000
FILL_TOKENS = 600  # how far past the compaction threshold the compaction run's reply goes
RUN_TIMEOUT_S = 240.0
_SHELL_NAMES = ("bash", "shell", "exec", "command", "terminal", "run")
_SHELL_ARGS = ("command", "cmd", "script")


class CheckReport(msgspec.Struct, frozen=True, kw_only=True):
    harness: str
    items: list[Item]
    calls: int
    exit_code: int
    duration_s: float

    @property
    def ok(self) -> bool:
        return not any(i.status == "fail" for i in self.items)


# --------------------------------------------------------------------------- the scripted model


def shell_tool(prompt_text: str) -> tuple[str, str] | None:
    """(tool name, command argument) of the shell tool among the schemas rendered in the prompt."""
    block = re.search(r"<tools>\n(.*?)\n</tools>", prompt_text, re.S)
    if block is None:
        return None
    found = []
    for line in block.group(1).splitlines():
        try:
            schema = json.loads(line)
        except ValueError:
            continue
        fn = schema.get("function", schema)
        props = (fn.get("parameters") or {}).get("properties") or {}
        arg = next((a for a in _SHELL_ARGS if a in props), None)
        if arg is not None:
            found.append((not any(s in fn.get("name", "").lower() for s in _SHELL_NAMES), fn["name"], arg))
    return (min(found)[1], min(found)[2]) if found else None


def _call(tool: tuple[str, str], command: str) -> str:
    return "<tool_call>\n" + json.dumps([{"name": tool[0], "arguments": {tool[1]: command}}]) + "\n</tool_call>"


class CheckEngine:
    """The scripted model of the module docstring; `fill` pads step 1's reply (compaction run)."""

    def __init__(self, tokenizer, *, fix_patch: str, end_command: str = "", fill_tokens: int = 0) -> None:
        self.policy_version = 0
        self.tokenizer = tokenizer
        self.fix = f"git apply <<'POLAR_EOF'\n{fix_patch}POLAR_EOF"
        self.end_command = end_command
        self.fill = " ".join(["context"] * fill_tokens)
        self.filled = ""  # the fill once sent: a prompt without it is compacted, and the task ends
        self.prompts: list[str] = []
        self.first_prompt_tokens = 0  # the longest prompt answered with step 1 (the main first request)

    def reply(self, text: str) -> str:
        tool = shell_tool(text)
        steps = text.count("<|im_start|>user\n<tool_response>")
        if tool is None:
            return "Done: nothing to do without a shell tool."
        if self.filled and self.filled not in text:
            steps = 2  # compacted: end the task rather than start over (it might compact again)
        if steps == 0:
            fill, self.filled = (f" {self.fill}", self.fill) if self.fill and not self.filled else ("", self.filled)
            return ("<think>\nFirst I look at the repository.\n</think>\nI'll look at the repository first."
                    f"{fill}\n" + _call(tool, MARK_COMMAND))
        if steps == 1:
            return "Now I apply the fix.\n" + _call(tool, self.fix)
        if self.end_command:
            return "Submitting.\n" + _call(tool, self.end_command)
        return "Done: the fix is applied."

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, *, session_id: str = "") -> Generation:
        text = await asyncio.to_thread(self.tokenizer.decode, list(prompt_ids))
        self.prompts.append(text)
        if "<|im_start|>user\n<tool_response>" not in text:
            self.first_prompt_tokens = max(self.first_prompt_tokens, len(prompt_ids))
        reply = self.reply(text)
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_tokens]
        return Generation(token_ids=ids, logprobs=[-0.01] * len(ids),
                          finish_reason="stop" if len(ids) < sampling.max_tokens else "length")

    async def update_weights(self, named_tensors, *, version: int) -> None:
        self.policy_version = version

    async def aclose(self) -> None:
        pass


# --------------------------------------------------------------------------- running it


class _Watched:
    """The harness agent, keeping its AgentResult (the pools keep only the rollout record)."""

    def __init__(self, agent) -> None:
        self.agent, self.name, self.result = agent, agent.name, None

    def spec(self, task, rollout_id: str):
        return self.agent.spec(task, rollout_id)

    async def run(self, box, task, **kw):
        self.result = await self.agent.run(box, task, **kw)
        return self.result


class _Run(msgspec.Struct, kw_only=True):
    record: RolloutRecord | None
    result: Any  # AgentResult | None
    calls: list[CallRecord]
    exchanges: list[ExchangeRecord]


def checking_config(cfg: Config, target: str) -> Config:
    """`cfg` as the check runs it: `target` (a name, or a definition file), scripted engine, a
    million-token window, one rollout at a time, no refusals of the CLI's long first prompt."""
    from polar_fast.rollouts.harnesses import select

    s = msgspec.structs.replace
    harness = select(cfg.harness, target)
    pools = s(cfg.pools, group_size=1, boot_workers=1, agent_workers=1, eval_workers=1, prewarm=0, infra_retries=0)
    return s(cfg, harness=s(harness, timeout_s=min(cfg.harness.timeout_s, RUN_TIMEOUT_S), max_steps=8),
             engine=s(cfg.engine, kind="scripted"), model=s(cfg.model, max_context_tokens=CHECK_CONTEXT),
             proxy=s(cfg.proxy, port=0, unix_socket=""), pools=pools, tasks=s(cfg.tasks, reward="binary"))


async def _run_once(cfg: Config, engine: CheckEngine, task) -> _Run:
    from polar_fast.pools import Pools
    from polar_fast.records import read_log
    from polar_fast.rollouts.stack import open_rollouts

    groups = []

    async def on_group(group) -> None:
        groups.append(group)

    work = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="polar-harness-check-"))
    try:
        async with open_rollouts(cfg, work, engine=engine) as r:
            watched = _Watched(r.agent)
            await Pools(cfg.pools, r.factory, watched, agent_timeout_s=cfg.harness.timeout_s).run([task], on_group)
        log = await asyncio.to_thread(read_log, work / "records.log")
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    member = groups[0].rollouts[0] if groups and groups[0].rollouts else None
    return _Run(record=member.record if member else None, result=watched.result,
                calls=list(member.calls) if member else [], exchanges=log.exchanges)


async def check_harness(cfg: Config, target: str) -> CheckReport:
    """Run the check (module docstring) for `target`: a harness name or a definition file."""
    import time

    from polar_fast.model import load_tokenizer
    from polar_fast.rollouts.harnesses import ModelLimits, run_harness
    from polar_fast.rollouts.tasks import load_builtin

    started = time.perf_counter()
    cfg = await asyncio.to_thread(checking_config, cfg, target)
    harness = await asyncio.to_thread(run_harness, cfg.harness)  # a bad definition stops here
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model.path)
    task = (await asyncio.to_thread(load_builtin))[0]
    end_command = getattr(harness, "end_command", "") or ""
    engine = CheckEngine(tokenizer, fix_patch=task.patch, end_command=end_command)
    run = await _run_once(cfg, engine, task)
    declared = getattr(getattr(harness, "definition", None), "api", "")  # a configured harness names its API
    items = [proxy_item(run, declared), None, tool_item(run, engine), history_item(run, tokenizer), end_item(run)]
    limits = ModelLimits(context_tokens=CHECK_CONTEXT, max_output_tokens=cfg.sampling.max_tokens)
    if harness.compaction_threshold(limits) is None:
        items[1] = not_applicable(AREA, "context", f"{harness.name} never compacts: it has no context setting, "
                                  "its prompt only grows (a run that outgrows the window ends on the context error)")
    elif not run.calls:
        items[1] = failed(AREA, "context", "not measured: no model call", "make the proxy line pass first")
    else:
        items[1] = await compaction_item(cfg, harness, task, tokenizer, engine.first_prompt_tokens, end_command)
    return CheckReport(harness=harness.name, items=items, calls=len(run.calls),
                       exit_code=run.result.exit_code if run.result else -1,
                       duration_s=round(time.perf_counter() - started, 1))


# --------------------------------------------------------------------------- the lines


def proxy_item(run: _Run, declared: str = "") -> Item:
    requests = run.result.requests if run.result else {}
    if not run.calls:
        tail = (run.result.output_tail if run.result else run.record.error if run.record else "")[-400:].strip()
        return failed(AREA, "proxy", f"no model call reached the proxy (exit {run.result.exit_code if run.result else '?'}"
                      f"): {tail}", "point the harness at {{ proxy_url }} / {{ proxy_url_v1 }} with {{ api_key }}")
    seen = ", ".join(f"{n} {kind}" for kind, n in sorted(requests.items()))
    routes = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
    dialects = sorted({c.dialect for c in run.calls})
    if declared and dialects != [declared]:
        return failed(AREA, "proxy", f"declared api = {declared!r}, but it spoke {', '.join(dialects)} ({seen} requests)",
                      "set `api` to the dialect it speaks")
    return passed(AREA, "proxy", f"{len(run.calls)} model calls on {', '.join(routes[d] for d in dialects)} "
                  f"({seen} requests)")


def tool_item(run: _Run, engine: CheckEngine) -> Item:
    if any(MARK_OUTPUT in m.content for e in run.exchanges for m in e.messages if m.role != "assistant"):
        return passed(AREA, "tool call", f"`{MARK_COMMAND}` ran: {MARK_OUTPUT!r} came back in the next request")
    if not run.calls:
        return failed(AREA, "tool call", "not reached: no model call", "make the proxy line pass first")
    tools = shell_tool(engine.prompts[0]) if engine.prompts else None
    if tools is None:
        return failed(AREA, "tool call", "its requests offer no shell tool (a tool with a `command` or `cmd` "
                      "argument) in a schema the proxy rendered", "check the harness sends its tools")
    return failed(AREA, "tool call", f"the call of {tools[0]!r} was never answered with its output "
                  f"(causes: {run.result.causes if run.result else {}})",
                  "check the harness parses the dialect's tool calls (see the proxy line)")


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def history_item(run: _Run, tokenizer) -> Item:
    calls = run.calls
    pairs = []  # (i, j, tokens in common): call j continues call i's conversation
    for j in range(1, len(calls)):
        joined = [list(c.prompt_ids) + list(c.completion_ids) for c in calls[:j]]
        common = [_common(p, calls[j].prompt_ids) for p in joined]
        i = max(range(j), key=lambda k: common[k])
        if common[i] > len(calls[i].prompt_ids) // 2:  # shares most of it: a continuation, not a side call
            pairs.append((i, j, common[i]))
    if not pairs:
        return failed(AREA, "history", f"no call continued an earlier one ({len(calls)} calls)",
                      "the harness must resend its conversation (see the tool call line)")
    broken = [(i, j, k) for i, j, k in pairs if k < len(calls[i].prompt_ids) + len(calls[i].completion_ids)]
    if not broken:
        return passed(AREA, "history", f"{len(pairs)} continuations token-exact: each prompt starts with the "
                      "previous prompt + its sampled ids")
    i, j, k = broken[0]
    expected = list(calls[i].prompt_ids) + list(calls[i].completion_ids)
    got = calls[j].prompt_ids
    want_text = tokenizer.decode(expected[k:k + 12])
    got_text = tokenizer.decode(list(got[k:k + 12]))
    lost = len(calls[i].completion_ids) - max(0, k - len(calls[i].prompt_ids))
    change = describe_change(run.exchanges, calls[i], calls[j])
    cost = merge_cost(calls)
    return failed(AREA, "history",
                  f"call {j} re-renders call {i}: first differing token at {k} (sampled {want_text!r}, "
                  f"sent back {got_text!r}; proxy: {calls[j].history}); the harness changed: {change}; "
                  f"cost: {cost}, {lost} of call {i}'s {len(calls[i].completion_ids)} sampled tokens come back "
                  "only as prompt",
                  "resend the assistant turn as it was answered (content, reasoning, tool calls)")


def describe_change(exchanges: list[ExchangeRecord], a: CallRecord, b: CallRecord) -> str:
    """What call b's request did to call a's reply, from the canonical conversations."""
    by_index = {(e.session_id, e.call_index): e for e in exchanges}
    ea, eb = by_index.get((a.session_id, a.call_index)), by_index.get((b.session_id, b.call_index))
    if ea is None or eb is None:
        return "unknown (no exchange records)"
    reply = ea.reply
    sent = eb.messages[len(ea.messages)] if len(eb.messages) > len(ea.messages) else None
    if sent is None or sent.role != "assistant":
        return "the reply is missing from the resent conversation"
    changes = []
    if reply.reasoning and not sent.reasoning:
        changes.append("reasoning dropped")
    if [(c.name, _json(c.arguments)) for c in reply.tool_calls] != [(c.name, _json(c.arguments)) for c in sent.tool_calls]:
        changes.append("tool call rewritten")
    if reply.content != sent.content:
        same = reply.content.split() == sent.content.split()
        changes.append("whitespace changed" if same else f"text changed ({reply.content[:40]!r} -> {sent.content[:40]!r})")
    if [m.role for m in eb.messages[: len(ea.messages)]] != [m.role for m in ea.messages] or any(
            x.content != y.content for x, y in zip(eb.messages, ea.messages)):
        changes.append("earlier messages edited")
    return ", ".join(changes) or "nothing in the canonical messages (a rendering difference)"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def merge_cost(calls: list[CallRecord]) -> str:
    from polar_fast.merge import merge

    stats = merge(calls, layout="tree").stats
    return (f"the merge breaks {stats.n_breaks} times (in_completion {stats.in_completion}, in_prompt "
            f"{stats.in_prompt}, new_root {stats.new_root}) and forwards {stats.n_nodes} tokens for "
            f"{stats.n_samples} sampled")


def end_item(run: _Run) -> Item:
    record, result = run.record, run.result
    if record is None or result is None:
        return failed(AREA, "end", "the rollout never finished", "see the proxy line")
    if record.outcome != Outcome.OK:
        tail = result.output_tail[-300:].strip().replace("\n", " | ")
        return failed(AREA, "end", f"{record.outcome.value}: {record.error}; output: {tail}",
                      "the harness must exit 0 when the model ends the task (set end_command if it ends by a "
                      "command)")
    return passed(AREA, "end", f"exit 0 after {len(run.calls)} calls; scored: reward {record.reward} "
                  f"(the fix was applied{'' if record.reward else ' but the tests did not pass'})")


async def compaction_item(cfg: Config, harness, task, tokenizer, first: int, end_command: str) -> Item:
    """A second run whose window puts the compaction threshold just past the first request, with a
    step-1 reply FILL_TOKENS past it: a later request must no longer hold the whole conversation."""
    from polar_fast.rollouts.harnesses import ModelLimits

    out = max(cfg.sampling.max_tokens, 2048)  # room for the filling reply
    window = first + out
    while harness.compaction_threshold(ModelLimits(context_tokens=window, max_output_tokens=out)) < first + 200:
        window += 256
    threshold = harness.compaction_threshold(ModelLimits(context_tokens=window, max_output_tokens=out))
    s = msgspec.structs.replace
    small = s(cfg, model=s(cfg.model, max_context_tokens=window), sampling=s(cfg.sampling, max_tokens=out))
    engine = CheckEngine(tokenizer, fix_patch=task.patch, end_command=end_command,
                         fill_tokens=threshold - first + FILL_TOKENS)
    calls = (await _run_once(small, engine, task)).calls
    evidence = f"told window {window:,} and output cap {out:,} (threshold {threshold:,})"
    filled = next((c for c in calls if len(c.prompt_ids) + len(c.completion_ids) > threshold), None)
    if filled is None:
        return failed(AREA, "context", f"{evidence}; the filling reply never took a call past it "
                      f"({len(calls)} calls)", "see the tool call line")
    joined = list(filled.prompt_ids) + list(filled.completion_ids)
    after = [c for c in calls if c.call_index > filled.call_index]
    compacted = [c for c in after if _common(joined, c.prompt_ids) < len(filled.prompt_ids)]
    evidence += f"; call {filled.call_index} reached {len(joined):,} tokens"
    if compacted:
        c = compacted[0]
        return passed(AREA, "context", f"{evidence}; call {c.call_index} ({len(c.prompt_ids):,} prompt tokens) "
                      "no longer holds the whole conversation: it compacted")
    return failed(AREA, "context", f"{evidence}; the {len(after)} calls after it all still hold it: no compaction",
                  "tell the harness the window and output cap ({{ context_window }}, {{ max_output_tokens }}) "
                  "where it reads them")


def format_report(report: CheckReport) -> str:
    from polar_fast.preflight import format_item

    lines = [format_item(i) for i in report.items]
    failures = sum(i.status == "fail" for i in report.items)
    lines.append(f"harnesses check {report.harness}: {len(report.items)} lines, {failures} failed, "
                 f"{sum(i.status == 'n/a' for i in report.items)} n/a ({report.calls} calls, {report.duration_s} s)")
    return "\n".join(lines)
