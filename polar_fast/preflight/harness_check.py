"""`python -m polar_fast harnesses check NAME|FILE [--config run.toml] [--json PATH]`: does a
harness train exactly? Answered by running it, before anyone spends GPU hours on it.

The harness (built-in, declared in the run's [harness], or declared in FILE) runs once on a
tiny built-in task, through the same bundle install, sandbox, pools and capture proxy as
training, with a scripted engine in place of the model (preflight/check_model.py). It acts the
way the harness does: through its shell tool (found by schema in any request, every required
argument filled), or, for a text-edit agent without tools, through edits in its own text format
(the definition's `[check] edit`):

1. a first action whose effect only a working harness shows back: the shell call
   `echo polar-check-$((6*7))` (`polar-check-42` is printed only if it ran), or an edit creating
   polar-check.txt holding `polar-check-42`;
2. the task's fix: a shell call applying its patch, or one edit per hunk;
3. the end of the task: the harness's `end_command` through the shell tool where it has one
   (mini-swe-agent's submit), else a plain final answer.

The lines, each pass, fail or n/a with its evidence (preflight.Item), each said from what was
observed:
- proxy: it reached the proxy; which dialect, streamed or not;
- context (check_calls.py): harnesses with a compaction threshold get a second run with a window
  just above their first request and a first reply that fills it; a later request of the main
  conversation must have compacted: the same system prompt with the conversation shortened, or
  a summary request followed by a conversation that starts again from the summary. Side calls
  (a title, a small-model request: they share little of the main prompt) are named, never
  counted. n/a without a threshold, saying what the run showed;
- tool call: the shell call ran and its output came back in a later request; for a text-edit
  agent, the edit was applied (the box holds the file after the run) and the file's text came
  back in a later request outside the model's own turns;
- history (check_calls.py): every continuation came back token-exact (the proxy reused the
  sampled ids). If not: the first differing token, against the prompt's length (before any
  sampled token: the harness rebuilt its prompt), what changed, and what it costs the merge;
- end: the harness exited 0 by itself and the rollout scored reward 1.0 (the fix passed the
  task's tests); anything else fails, with the changes the repo held after the run.
The check runs with `proxy.history` as configured (exact by default), on a local sandbox unless
the config says docker, and tells the proxy the model takes a million tokens (a CLI's system
prompt and tool schemas outgrow a small model's window; the scripted engine has none).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from polar_fast.config import Config
from polar_fast.preflight import Item, failed, passed
from polar_fast.preflight.check_calls import AREA, compaction_item, context_not_measured, history_item
from polar_fast.preflight.check_model import MARK_COMMAND, MARK_FILE, MARK_OUTPUT, CheckEngine
from polar_fast.records import CallRecord, ExchangeRecord, Outcome, RolloutRecord

CHECK_CONTEXT = 1_000_000
RUN_TIMEOUT_S = 240.0
_SEPARATOR = "----polar-check-status----"


class CheckReport(msgspec.Struct, frozen=True, kw_only=True):
    harness: str
    items: list[Item]
    calls: int
    exit_code: int
    duration_s: float

    @property
    def ok(self) -> bool:
        return not any(i.status == "fail" for i in self.items)


# --------------------------------------------------------------------------- running it


class AfterRun(msgspec.Struct, frozen=True, kw_only=True):
    """The task repo as the harness left it, read in the box before the tests run."""

    mark: str | None  # MARK_FILE's text; None when there is no such file
    changes: str  # `git status --short`


class _Watched:
    """The harness agent, keeping its AgentResult (the pools keep only the rollout record) and
    what the repo holds when it ends."""

    def __init__(self, agent) -> None:
        self.agent, self.name, self.result, self.after = agent, agent.name, None, None

    def spec(self, task, rollout_id: str):
        return self.agent.spec(task, rollout_id)

    async def run(self, box, task, **kw):
        self.result = await self.agent.run(box, task, **kw)
        self.after = await _look(box)
        return self.result


async def _look(box) -> AfterRun | None:
    script = (f"cat {MARK_FILE} 2>/dev/null || printf '%s' '{_SEPARATOR}missing'; echo '{_SEPARATOR}'; "
              "git status --short")
    try:
        done = await box.exec(["sh", "-c", script], cwd=box.workdir, timeout_s=30)
    except Exception:  # noqa: BLE001 - a box that died: the pools report it; the lines say "unknown"
        return None
    mark, _, changes = done.stdout.rpartition(f"{_SEPARATOR}\n")
    return AfterRun(mark=None if mark == f"{_SEPARATOR}missing" else mark, changes=changes.strip())


class _Run(msgspec.Struct, kw_only=True):
    record: RolloutRecord | None
    result: Any  # AgentResult | None
    calls: list[CallRecord]
    exchanges: list[ExchangeRecord]
    after: AfterRun | None = None


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


async def run_once(cfg: Config, engine: CheckEngine, task) -> _Run:
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
                calls=list(member.calls) if member else [], exchanges=log.exchanges, after=watched.after)


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
    acting = dict(fix_patch=task.patch, end_command=getattr(harness, "end_command", "") or "",
                  edit_reply=getattr(harness, "edit_reply", None))
    engine = CheckEngine(tokenizer, **acting)
    run = await run_once(cfg, engine, task)
    declared = getattr(getattr(harness, "definition", None), "api", "")  # a configured harness names its API
    items = [proxy_item(run, declared), None, tool_item(run, engine), history_item(run.calls, run.exchanges, tokenizer),
             end_item(run, engine)]
    limits = ModelLimits(context_tokens=CHECK_CONTEXT, max_output_tokens=cfg.sampling.max_tokens)
    if harness.compaction_threshold(limits) is None:
        items[1] = context_not_measured(harness.name, run.calls, CHECK_CONTEXT)
    elif not run.calls:
        items[1] = failed(AREA, "context", "not measured: no model call", "make the proxy line pass first")
    else:
        items[1] = await compaction_item(cfg, harness, task, tokenizer, engine.first_prompt_tokens, acting, run_once)
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


def _shown_in(run: _Run, text: str) -> ExchangeRecord | None:
    """The first request that shows `text` outside the model's own turns."""
    for e in sorted(run.exchanges, key=lambda e: e.call_index):
        if any(text in m.content for m in e.messages if m.role != "assistant"):
            return e
    return None


def tool_item(run: _Run, engine: CheckEngine) -> Item:
    if not run.calls:
        return failed(AREA, "tool call", "not reached: no model call", "make the proxy line pass first")
    tool = engine.tool
    if tool is None and engine.edit_reply is not None:
        return edit_item(run, engine)
    shown = _shown_in(run, MARK_OUTPUT)
    if tool is not None and shown is not None:
        filled = f", and its required {', '.join(tool.required)} filled from its schema" if tool.required else ""
        return passed(AREA, "tool call", f"`{tool.name}` called with {tool.command_arg} = `{MARK_COMMAND}`{filled}: "
                      f"{MARK_OUTPUT!r} came back in call {shown.call_index}")
    if tool is None:
        return failed(AREA, "tool call", f"none of its {len(engine.prompts)} requests offers a shell tool (a tool with a "
                      "`command`, `cmd` or `script` argument) in a schema the proxy rendered, and its definition has "
                      "no [check] edit reply", "check the harness sends its tools; a CLI that edits files from its "
                      "replies declares how in [check] edit (docs/harnesses.md)")
    sent = tool.call(MARK_COMMAND).split("\n")[1]
    return failed(AREA, "tool call", f"the call {sent} was never answered with its output "
                  f"(causes: {run.result.causes if run.result else {}})",
                  "check the harness parses the dialect's tool calls (see the proxy line)")


def edit_item(run: _Run, engine: CheckEngine) -> Item:
    """A text-edit agent's tool call line: its edit reply was applied, and shown back."""
    after = run.after
    sends = engine.sent["first"]
    if after is None:
        return failed(AREA, "tool call", "unknown: the box could not be read after the run", "see the end line")
    if after.mark is None or MARK_OUTPUT not in after.mark:
        held = "does not exist" if after.mark is None else f"holds {after.mark[:60]!r}"
        return failed(AREA, "tool call", f"the edit reply creating {MARK_FILE} (sent {sends} times) was not applied: "
                      f"after the run {MARK_FILE} {held}; the repo's changes: {after.changes.replace(chr(10), ', ') or 'none'}",
                      "write [check] edit in the format the CLI applies (a file to create has old text \"\")")
    shown = _shown_in(run, MARK_OUTPUT)
    if shown is None:
        return failed(AREA, "tool call", f"the edit reply was applied ({MARK_FILE} holds {MARK_OUTPUT!r} after the "
                      f"run), but none of its {len(run.calls)} requests showed that back: the model never saw the "
                      "effect of its edit", "make the CLI send another request after an edit, holding the file or "
                      "what the edit did (aider: --auto-test with a --test-cmd that reports the changes)")
    return passed(AREA, "tool call", f"the edit reply was applied ({MARK_FILE} holds {MARK_OUTPUT!r} after the run) "
                  f"and call {shown.call_index} showed it back, outside the model's own turns")


def end_item(run: _Run, engine: CheckEngine) -> Item:
    record, result = run.record, run.result
    if record is None or result is None:
        return failed(AREA, "end", "the rollout never finished", "see the proxy line")
    if record.outcome != Outcome.OK:
        tail = result.output_tail[-300:].strip().replace("\n", " | ")
        return failed(AREA, "end", f"{record.outcome.value}: {record.error}; output: {tail}",
                      "the harness must exit 0 when the model ends the task (set end_command if it ends by a "
                      "command)")
    if record.reward == 1.0:
        return passed(AREA, "end", f"exit 0 after {len(run.calls)} calls; scored: reward 1.0 (the task's tests pass)")
    fixes = engine.sent["fix"]
    sent = f"the scripted fix was sent {fixes} time(s)" if fixes else "the scripted fix was never sent"
    changes = run.after.changes.replace("\n", ", ") if run.after else "unknown"
    return failed(AREA, "end", f"exit 0 after {len(run.calls)} calls, but reward {record.reward}: the task's tests "
                  f"do not pass; {sent}, and after the run the repo's changes were: {changes or 'none'}",
                  "see the tool call line: the fix must reach the repo through the harness")


def format_report(report: CheckReport) -> str:
    from polar_fast.preflight import format_item

    lines = [format_item(i) for i in report.items]
    failures = sum(i.status == "fail" for i in report.items)
    lines.append(f"harnesses check {report.harness}: {len(report.items)} lines, {failures} failed, "
                 f"{sum(i.status == 'n/a' for i in report.items)} n/a ({report.calls} calls, {report.duration_s} s)")
    return "\n".join(lines)
