"""`python -m polar_fast export`: a run's test-verified sessions as SFT data.

    export_run("runs/default", "sft/", min_reward=1.0) -> one-paragraph report

Reads `<run>/records.log` and keeps rollouts whose outcome is ok and reward >= `min_reward`,
leaving out evaluation rollouts (`purpose = "eval"`: held-out tasks stay held out).
Writes four files, each loadable with `datasets.load_dataset("json" | "parquet", data_files=...)`:

    chat.jsonl, chat.parquet     {messages, tools, provenance}: one row per final conversation
    tokens.jsonl, tokens.parquet {input_ids, loss_mask, provenance}: one row per merged path

Choices:
- Chat rows come from ExchangeRecords (the canonical conversation of each call). A rollout's
  final conversations are its exchanges that no later exchange of the rollout extends (messages
  + reply as a prefix, same tools; compared by role, stripped content and tool-call name +
  JSON arguments, as the proxy's exact-history match does). A plain run has one; compaction,
  sub-agents or edited history leave several, and each is a row.
- Messages are OpenAI chat format with every key in every message (role, content,
  reasoning_content, tool_calls [{id, type, function {name, arguments}}], tool_call_id, name),
  so Arrow infers one schema. Tool-call `arguments` and the `tools` column are JSON text (OpenAI
  function-tool objects): tool schemas differ per harness, and as nested columns Arrow would
  merge them into one struct of every key ever seen, or fail on a type clash.
- When a harness dropped the reasoning from an earlier assistant turn, the reasoning the model
  actually produced (that call's reply) is put back.
- Token rows: each kept rollout's calls are merged in "paths" layout; `loss_mask` is 1 on every
  token the policy sampled, in every path containing it, so each row stands alone (the merge's
  own mask counts a shared token once over all paths).
- Guided rollouts (their first calls answered by a teacher, CallRecord.guided): the guided calls
  are left out of the merge, so the teacher's tokens appear only as later prompts, at loss mask 0;
  they give no chat rows, which would present the teacher's turns as the policy's.
- Dedup: identical rows are written once (sha256 of messages + tools with tool-call ids
  renumbered, since the proxy draws fresh ids per call; of ids + mask for token rows). The first
  occurrence keeps its provenance.
- Provenance: task_id, harness, model, policy_version (newest policy that sampled any token of
  the row), rollout_id, group_id, session_id, reward.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import msgspec
import numpy as np

from polar_fast.conversation import Message, Tool
from polar_fast.errors import PolarError
from polar_fast.records import (
    CallRecord,
    ExchangeRecord,
    Outcome,
    RolloutRecord,
    read_log,
    whole_calls,
    whole_exchanges,
)

CHAT_FILES = ("chat.jsonl", "chat.parquet")
EVAL = "eval"  # RolloutRecord.purpose of an evaluation sample (evaluate.py): never exported
TOKEN_FILES = ("tokens.jsonl", "tokens.parquet")


class ExportError(PolarError):
    """The run directory cannot be exported (no records.log, ...)."""


class Provenance(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    harness: str
    model: str
    policy_version: int
    rollout_id: str
    group_id: str
    session_id: str
    reward: float


def export_run(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, min_reward: float = 1.0) -> str:
    """Write the SFT files for `run_dir` into `out_dir` (see the module docstring); return a report."""
    log_path = Path(run_dir) / "records.log"
    if not log_path.is_file():
        raise ExportError(f"{log_path} not found: --run takes a run's output_dir")
    contents = read_log(log_path)
    kept = _kept_rollouts(contents.rollouts, min_reward)
    calls: dict[str, list[CallRecord]] = defaultdict(list)
    exchanges: dict[str, list[ExchangeRecord]] = defaultdict(list)
    # calls and exchanges whole again (the log stores deltas)
    completed_calls, incomplete_calls = whole_calls(r for r in contents.records if isinstance(r, CallRecord))
    for call in completed_calls:
        if call.rollout_id in kept:
            calls[call.rollout_id].append(call)
    completed_exchanges, incomplete_exchanges = whole_exchanges(r for r in contents.records if isinstance(r, ExchangeRecord))
    for exchange in completed_exchanges:
        if exchange.rollout_id in kept:
            exchanges[exchange.rollout_id].append(exchange)

    chat_rows = _Dedup()
    token_rows = _Dedup()
    guided = 0
    for rollout in kept.values():
        mine = calls[rollout.rollout_id]
        sampled = [c for c in mine if not c.guided]
        if len(sampled) < len(mine):  # its first turns are a teacher's: a chat row would train on them as the policy's
            guided += 1
        else:
            for row in chat_rows_of(rollout, exchanges[rollout.rollout_id], mine):
                chat_rows.add(_chat_key(row), row)
        # guided calls are left out of the merge: their tokens appear only as later prompts, loss mask 0
        for row in token_rows_of(rollout, sampled, _model_of(exchanges[rollout.rollout_id])):
            token_rows.add(_token_key(row), row)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write(out, "chat", chat_rows.rows, _chat_schema())
    _write(out, "tokens", token_rows.rows, _token_schema())
    return _report(out, contents, kept, exchanges, chat_rows, token_rows, min_reward, incomplete_calls, incomplete_exchanges,
                   guided)


# ------------------------------------------------------------------------------------- selection


def _kept_rollouts(rollouts: Iterable[RolloutRecord], min_reward: float) -> dict[str, RolloutRecord]:
    kept: dict[str, RolloutRecord] = {}
    for r in rollouts:  # a rollout id logged twice (a resumed run): the last record wins
        kept.pop(r.rollout_id, None)
        if r.purpose == EVAL:  # held-out tasks: exporting them would train on the eval set
            continue
        if r.outcome is Outcome.OK and r.reward is not None and r.reward >= min_reward:
            kept[r.rollout_id] = r
    return kept


def _model_of(exchanges: list[ExchangeRecord]) -> str:
    return exchanges[-1].model if exchanges else ""


# ------------------------------------------------------------------------------------- chat rows


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _message_key(m: Message) -> tuple:
    """What makes two messages the same turn: ids, reasoning and surrounding whitespace aside."""
    calls = tuple((c.name, json.dumps(_json_value(c.arguments), sort_keys=True)) for c in m.tool_calls)
    return m.role, m.content.strip(), calls


def _tools_key(tools: list[Tool]) -> str:
    return json.dumps([[t.name, t.description, t.parameters] for t in tools], sort_keys=True)


class _Chains:
    """Prefix lookups over one rollout's exchanges: which conversations extend which."""

    def __init__(self, exchanges: list[ExchangeRecord]) -> None:
        self.keys = [[_message_key(m) for m in e.messages] for e in exchanges]
        self.tools = [_tools_key(e.tools) for e in exchanges]
        self.reply_keys = [_message_key(e.reply) for e in exchanges]
        # (tools, message keys up to and including an exchange's reply) -> that exchange
        self.answered = {(self.tools[i], tuple(k) + (self.reply_keys[i],)): i for i, k in enumerate(self.keys)}

    def extended_by_another(self, i: int) -> bool:
        full = tuple(self.keys[i]) + (self.reply_keys[i],)
        return any(j != i and self.tools[j] == self.tools[i] and len(k) >= len(full) and tuple(k[: len(full)]) == full
                   for j, k in enumerate(self.keys))

    def answering(self, i: int, position: int) -> int | None:
        """The exchange whose reply is message `position` of exchange i's conversation."""
        return self.answered.get((self.tools[i], tuple(self.keys[i][: position + 1])))


def final_conversations(exchanges: list[ExchangeRecord]) -> list[tuple[ExchangeRecord, list[Message]]]:
    """Each exchange no other one extends, with its full conversation (messages + reply) and
    any reasoning a harness dropped from an earlier assistant turn restored from that call's reply."""
    chains = _Chains(exchanges)
    finals = []
    for i, e in enumerate(exchanges):
        if chains.extended_by_another(i):
            continue
        messages = list(e.messages)
        for pos, m in enumerate(messages):
            if m.role == "assistant" and not m.reasoning:
                j = chains.answering(i, pos)
                if j is not None and exchanges[j].reply.reasoning:
                    messages[pos] = msgspec.structs.replace(m, reasoning=exchanges[j].reply.reasoning)
        finals.append((e, messages + [e.reply]))
    return finals


def _openai_message(m: Message, tool_names: dict[str, str]) -> dict[str, Any]:
    return {
        "role": m.role,
        "content": m.content,
        "reasoning_content": m.reasoning,
        "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                       for c in m.tool_calls],
        "tool_call_id": m.tool_call_id,
        "name": tool_names.get(m.tool_call_id, "") if m.role == "tool" else "",
    }


def _openai_tools(tools: list[Tool]) -> str:
    return json.dumps([{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.parameters}} for t in tools])


def chat_rows_of(rollout: RolloutRecord, exchanges: list[ExchangeRecord], calls: list[CallRecord]) -> list[dict]:
    rows = []
    for final, messages in final_conversations(exchanges):
        tool_names = {c.id: c.name for m in messages for c in m.tool_calls}
        versions = [c.policy_version for c in calls
                    if c.session_id == final.session_id and c.call_index <= final.call_index]
        provenance = _provenance(rollout, final.model, max(versions, default=-1), final.session_id)
        rows.append({"messages": [_openai_message(m, tool_names) for m in messages],
                     "tools": _openai_tools(final.tools), "provenance": provenance})
    return rows


def _provenance(rollout: RolloutRecord, model: str, version: int, session_id: str) -> dict[str, Any]:
    return msgspec.structs.asdict(Provenance(
        task_id=rollout.task_id, harness=rollout.harness, model=model, policy_version=version,
        rollout_id=rollout.rollout_id, group_id=rollout.group_id, session_id=session_id,
        reward=float(rollout.reward if rollout.reward is not None else 0.0),
    ))


def _chat_key(row: dict) -> str:
    ids: dict[str, str] = {}  # tool-call ids renumbered in order of appearance

    def renumber(call_id: str) -> str:
        return ids.setdefault(call_id, f"#{len(ids)}") if call_id else ""

    normal = []
    for m in row["messages"]:
        calls = [[renumber(c["id"]), c["function"]["name"], _json_value(c["function"]["arguments"])]
                 for c in m["tool_calls"]]
        normal.append([m["role"], m["content"], m["reasoning_content"], calls, renumber(m["tool_call_id"])])
    text = json.dumps([normal, json.loads(row["tools"])], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------------ token rows


def token_rows_of(rollout: RolloutRecord, calls: list[CallRecord], model: str) -> list[dict]:
    if not calls:
        return []
    from polar_fast.merge import merge

    merged = merge(calls, layout="paths")
    sampled = np.isin(merged.node, merged.node[merged.loss_mask.astype(bool)])
    rows = []
    for a, b in zip(merged.offsets[:-1].tolist(), merged.offsets[1:].tolist()):
        mask = sampled[a:b]
        versions = merged.versions[a:b][merged.loss_mask[a:b].astype(bool)]
        # A path's newest sampler; for tokens first sampled on another path, their calls bound it.
        version = int(versions.max()) if len(versions) else max(c.policy_version for c in calls)
        session = ",".join(sorted({c.session_id for c in calls}))
        rows.append({"input_ids": merged.tokens[a:b].tolist(), "loss_mask": mask.astype(np.int8).tolist(),
                     "provenance": _provenance(rollout, model, version, session)})
    return rows


def _token_key(row: dict) -> str:
    digest = hashlib.sha256(np.asarray(row["input_ids"], dtype=np.int64).tobytes())
    digest.update(np.asarray(row["loss_mask"], dtype=np.int8).tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------- output


class _Dedup:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.seen: set[str] = set()
        self.duplicates = 0

    def add(self, key: str, row: dict) -> None:
        if key in self.seen:
            self.duplicates += 1
        else:
            self.seen.add(key)
            self.rows.append(row)


def _provenance_type():
    import pyarrow as pa

    return pa.struct([(f, pa.int64() if f == "policy_version" else pa.float64() if f == "reward" else pa.string())
                      for f in Provenance.__struct_fields__])


def _chat_schema():
    import pyarrow as pa

    call = pa.struct([("id", pa.string()), ("type", pa.string()),
                      ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
                         ("tool_calls", pa.list_(call)), ("tool_call_id", pa.string()), ("name", pa.string())])
    return pa.schema([("messages", pa.list_(message)), ("tools", pa.string()), ("provenance", _provenance_type())])


def _token_schema():
    import pyarrow as pa

    return pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                      ("provenance", _provenance_type())])


def _write(out: Path, stem: str, rows: list[dict], schema) -> None:
    """JSONL and parquet, each written to a temp name and renamed, so a reader never sees half."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    encoder = msgspec.json.Encoder()
    tmp = out / f".{stem}.jsonl.tmp"
    with open(tmp, "wb") as f:
        for row in rows:
            f.write(encoder.encode(row) + b"\n")
    tmp.replace(out / f"{stem}.jsonl")
    tmp = out / f".{stem}.parquet.tmp"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp)
    tmp.replace(out / f"{stem}.parquet")


def _report(out, contents, kept, exchanges, chat_rows, token_rows, min_reward, incomplete_calls, incomplete_exchanges,
            guided: int = 0) -> str:
    scored = len({r.rollout_id for r in contents.rollouts})
    lines = [
        f"{len(kept)} of {scored} rollouts kept (outcome ok, reward >= {min_reward:g})",
        f"chat: {len(chat_rows.rows)} rows ({chat_rows.duplicates} duplicates dropped) -> "
        + ", ".join(str(out / f) for f in CHAT_FILES),
        f"tokens: {len(token_rows.rows)} rows ({token_rows.duplicates} duplicates dropped) -> "
        + ", ".join(str(out / f) for f in TOKEN_FILES),
    ]
    last = {r.rollout_id: r for r in contents.rollouts}
    held_out = sum(1 for r in last.values() if r.purpose == EVAL)
    if held_out:
        lines.append(f"{held_out} evaluation rollouts (held-out tasks) left out: they are never exported")
    if guided:
        lines.append(f"{guided} kept rollouts were guided (their first calls answered by a teacher): token rows only, "
                     "with the teacher's tokens at loss mask 0; no chat rows")
    missing = sum(1 for rid in kept if not exchanges.get(rid))
    if missing:
        lines.append(f"note: {missing} kept rollouts have no exchange records (logged before exchanges existed): "
                     "token rows only")
    if incomplete_calls or incomplete_exchanges:
        lines.append(f"note: {incomplete_calls} call and {incomplete_exchanges} exchange records left out: the earlier "
                     "record holding the start of their prompt or conversation is missing from the log")
    if contents.torn_bytes:
        lines.append(f"note: records.log ends in {contents.torn_bytes} torn bytes ({contents.torn_reason}); "
                     "every complete record before them was read")
    return "\n".join(lines)
