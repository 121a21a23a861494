"""SFT export from a real record log: calls captured by the real proxy (scripted engine, real
SmolLM2 tokenizer and template) over HTTP in two dialects, plus rollout records; the export is
loaded back with `datasets` (JSONL and parquet) and checked for tool schemas and tool calls,
restored reasoning, dedup, compaction (two final conversations), the reward filter, and evaluation
rollouts left out."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import aiohttp
import anyio
import pytest

from polar_fast.export import export_run
from polar_fast.records import Outcome, RecordLog, RolloutRecord, read_log
from polar_fast.testing import scripted_proxy

SCHEMA = {"type": "object", "properties": {"command": {"type": "string", "description": "shell"}},
          "required": ["command"]}
TOOL_CALL = '<think>\nI will write the file.\n</think>\n<tool_call>\n{"name": "bash", "arguments": {"command": "echo hi > a.txt"}}\n</tool_call>'
REPLIES = [TOOL_CALL, "Done.", TOOL_CALL, "Done.", TOOL_CALL, "Nope.", TOOL_CALL, "Done.", "All good."]
# rollout -> (reward, dialect, user prompt); r0 and r1 are the same conversation (dedup), r2 fails
# its tests, g1-r0 is compacted after its second call (a fresh conversation: two final ones).
ROLLOUTS = {"g0-r0": (1.0, "chat", "write a.txt"), "g0-r1": (1.0, "chat", "write a.txt"),
            "g0-r2": (0.0, "chat", "write b.txt"), "g1-r0": (1.0, "anthropic", "write a.txt now")}


async def _chat_session(http, url: str, prompt: str) -> None:
    req = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
           "tools": [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": SCHEMA}}]}
    async with http.post(url + "/v1/chat/completions", json=req) as r:
        message = (await r.json())["choices"][0]["message"]
    assert message["reasoning_content"] == "I will write the file."
    call = message["tool_calls"][0]
    # Like most harnesses, send the assistant turn back without its reasoning.
    req["messages"] += [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    async with http.post(url + "/v1/chat/completions", json=req) as r:
        assert r.status == 200, await r.text()


async def _anthropic_session(http, url: str, prompt: str) -> None:
    req = {"model": "m", "max_tokens": 256, "system": "Be brief.", "messages": [{"role": "user", "content": prompt}],
           "tools": [{"name": "bash", "description": "run", "input_schema": SCHEMA}]}
    async with http.post(url + "/v1/messages", json=req) as r:
        use = [b for b in (await r.json())["content"] if b["type"] == "tool_use"][0]
    req["messages"] += [{"role": "assistant", "content": [use]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}]}]
    async with http.post(url + "/v1/messages", json=req) as r:
        assert r.status == 200
    compacted = {**req, "messages": [{"role": "user", "content": "Summary: a.txt is written. Check it."}]}
    async with http.post(url + "/v1/messages", json=compacted) as r:
        assert r.status == 200


async def _capture(tmp_path) -> None:
    async with scripted_proxy(tmp_path, REPLIES) as px, aiohttp.ClientSession() as http:
        for rollout_id, (_, dialect, prompt) in ROLLOUTS.items():
            token = await px.new_session(rollout_id, rollout_id.split("-")[0])
            session = _chat_session if dialect == "chat" else _anthropic_session
            await session(http, f"{px.root_url}/s/{token}", prompt)
        assert px.engine.remaining() == 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    anyio.run(_capture, tmp, backend="asyncio", backend_options={"use_uvloop": True})
    run = tmp / "run"
    run.mkdir()
    shutil.copy(tmp / "calls.log", run / "records.log")
    with RecordLog(run / "records.log") as log:
        for rollout_id, (reward, _, _) in ROLLOUTS.items():
            log.append(RolloutRecord(rollout_id=rollout_id, group_id=rollout_id.split("-")[0], task_id="toy/a",
                                     harness="codex", outcome=Outcome.OK, reward=reward, n_calls=2))
        log.append(RolloutRecord(rollout_id="g2-r0", group_id="g2", task_id="toy/a", harness="codex",
                                 outcome=Outcome.INFRA_ERROR))
    return run


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    report = export_run(run_dir, out)
    return out, report


def test_log_holds_an_exchange_per_call(run_dir):
    contents = read_log(run_dir / "records.log")
    assert len(contents.calls) == len(contents.exchanges) == len(REPLIES)
    for call, exchange in zip(contents.calls, contents.exchanges):
        assert (call.session_id, call.call_index) == (exchange.session_id, exchange.call_index)
        assert exchange.model == "smollm2-135m-instruct"
    first = contents.exchanges[0]
    assert [m.role for m in first.messages] == ["system", "user"] and first.tools[0].parameters == SCHEMA
    assert first.reply.reasoning == "I will write the file." and first.reply.tool_calls[0].name == "bash"


def test_chat_rows_load_with_tools_and_tool_calls(exported):
    import datasets

    out, report = exported
    rows = datasets.load_dataset("json", data_files=str(out / "chat.jsonl"), split="train")
    # g0-r0 (g0-r1 is its duplicate, g0-r2 scored 0) and g1-r0's two final conversations.
    assert len(rows) == 3, report
    assert "3 rows (1 duplicates dropped)" in report and "3 of 5 rollouts kept" in report
    by_rollout = {}
    for row in rows:
        by_rollout.setdefault(row["provenance"]["rollout_id"], []).append(row)
    assert sorted(by_rollout) == ["g0-r0", "g1-r0"]
    (chat,) = by_rollout["g0-r0"]
    assert json.loads(chat["tools"]) == [{"type": "function", "function": {"name": "bash", "description": "run",
                                                                            "parameters": SCHEMA}}]
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    system, user, call_turn, result, final = chat["messages"]
    assert user["content"] == "write a.txt" and final["content"] == "Done." and final["tool_calls"] == []
    (call,) = call_turn["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "echo hi > a.txt"}
    assert result["tool_call_id"] == call["id"] and result["name"] == "bash" and result["content"] == "ok"
    assert call_turn["reasoning_content"] == "I will write the file."  # restored: the client dropped it
    assert chat["provenance"] == {"task_id": "toy/a", "harness": "codex", "model": "smollm2-135m-instruct",
                                  "policy_version": 0, "rollout_id": "g0-r0", "group_id": "g0",
                                  "session_id": chat["provenance"]["session_id"], "reward": 1.0}

    long, compacted = sorted(by_rollout["g1-r0"], key=lambda r: -len(r["messages"]))
    assert [m["role"] for m in long["messages"]] == roles  # Anthropic's tool_result became a tool turn
    assert json.loads(long["messages"][2]["tool_calls"][0]["function"]["arguments"]) == {"command": "echo hi > a.txt"}
    assert [(m["role"], m["content"]) for m in compacted["messages"]][1:] == [
        ("user", "Summary: a.txt is written. Check it."), ("assistant", "All good.")]


def test_parquet_matches_jsonl(exported):
    import datasets

    out, _ = exported
    files = {"jsonl": str(out / "chat.jsonl"), "parquet": str(out / "chat.parquet")}
    from_json = datasets.load_dataset("json", data_files=files["jsonl"], split="train")
    from_parquet = datasets.load_dataset("parquet", data_files=files["parquet"], split="train")
    assert from_parquet.to_list() == from_json.to_list()
    tokens = datasets.load_dataset("parquet", data_files=str(out / "tokens.parquet"), split="train")
    assert tokens.to_list() == datasets.load_dataset("json", data_files=str(out / "tokens.jsonl"), split="train").to_list()


def test_token_rows_are_the_sampled_paths(exported, run_dir):
    from polar_fast.model import load_tokenizer

    out, report = exported
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    # g0-r0 is one chain; g0-r1 duplicates it exactly; g1-r0 has its chain and the compacted branch.
    assert len(rows) == 3 and "tokens: 3 rows (1 duplicates dropped)" in report
    calls = {}
    for c in read_log(run_dir / "records.log").calls:
        calls.setdefault(c.rollout_id, []).append(c)
    first, second = calls["g0-r0"]
    (row,) = [r for r in rows if r["provenance"]["rollout_id"] == "g0-r0"]
    assert row["input_ids"] == second.prompt_ids + second.completion_ids
    sampled = [i for i, m in enumerate(row["loss_mask"]) if m]
    start1, start2 = len(first.prompt_ids), len(second.prompt_ids)
    assert sampled == list(range(start1, start1 + len(first.completion_ids))) + \
        list(range(start2, start2 + len(second.completion_ids)))
    text = load_tokenizer("").decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert "<tool_call>" in text and "Done." in text and "Be brief" not in text


def test_min_reward_and_cli(run_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "polar_fast", "export", "--run", str(run_dir), "--out",
                           str(tmp_path / "all"), "--min-reward", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 of 5 rollouts kept" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "all" / "chat.jsonl").read_text().splitlines()]
    assert {r["provenance"]["rollout_id"] for r in rows} == {"g0-r0", "g0-r2", "g1-r0"}
    assert {r["provenance"]["reward"] for r in rows} == {0.0, 1.0}

    missing = subprocess.run([sys.executable, "-m", "polar_fast", "export", "--run", str(tmp_path / "nope"), "--out",
                              str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "records.log not found" in missing.stderr


def test_evaluation_rollouts_are_never_exported(run_dir, tmp_path):
    """A held-out eval's rollouts share the run's records.log (purpose "eval"): exporting them
    would put the eval set into SFT data, so they are left out whatever their reward."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(run_dir / "records.log", run / "records.log")
    with RecordLog(run / "records.log") as log:  # g1-r0 (reward 1) re-logged as an eval sample: the last record wins
        log.append(RolloutRecord(rollout_id="g1-r0", group_id="g1", task_id="toy/a", harness="codex",
                                 outcome=Outcome.OK, reward=1.0, n_calls=3, purpose="eval"))
    report = export_run(run, tmp_path / "sft", min_reward=0.0)
    rows = [json.loads(line) for line in (tmp_path / "sft" / "chat.jsonl").read_text().splitlines()]
    tokens = [json.loads(line) for line in (tmp_path / "sft" / "tokens.jsonl").read_text().splitlines()]
    assert {r["provenance"]["rollout_id"] for r in rows} == {"g0-r0", "g0-r2"}
    assert "g1-r0" not in {r["provenance"]["rollout_id"] for r in tokens}
    assert "3 of 5 rollouts kept" in report and "1 evaluation rollouts (held-out tasks) left out" in report
