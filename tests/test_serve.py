"""`python -m polar_fast serve` as a user runs it: a subprocess with a scripted engine from
run.toml, a session and a tool-calling chat completion over real HTTP, Ctrl-C (SIGINT), exit 0,
and the call (ids and conversation) in the run's records.log."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from polar_fast.records import read_log

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
TOOL_CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
STARTUP_S = 90.0


def _config(tmp_path) -> str:
    replies = json.dumps([TOOL_CALL, "Done."])
    text = f'[run]\noutput_dir = "{tmp_path / "run"}"\n\n[engine]\nkind = "scripted"\nscripted_replies = {replies}\n'
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "polar_fast", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_url(proc: subprocess.Popen) -> str:
    """The URL from the proxy's first line; fails with its stderr if it exits or stays silent."""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if selector.select(timeout=1.0):
                line = proc.stdout.readline()
                if match := re.search(r"proxy on (http://\S+)", line):
                    return match.group(1)
                if not line:
                    break
    proc.kill()
    pytest.fail(f"serve did not print its URL (exit {proc.wait()}): {proc.stderr.read()}")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def test_serve_records_until_ctrl_c(tmp_path):
    with _start("--config", _config(tmp_path), "--host", "127.0.0.1", "--port", "0") as proc:
        _use_then_interrupt(proc)
    contents = read_log(tmp_path / "run" / "records.log")
    assert contents.torn_bytes == 0
    (record,) = contents.calls
    assert record.rollout_id == "by-hand-1" and record.finish_reason == "tool_calls" and record.completion_ids
    (exchange,) = contents.exchanges
    assert exchange.messages[0].content == "list files" and exchange.reply.tool_calls[0].name == "bash"


def _use_then_interrupt(proc: subprocess.Popen) -> None:
    try:
        url = _wait_for_url(proc)
        session = _post(f"{url}/sessions", {"rollout_id": "by-hand-1"})
        assert session["base_url"] == f"{url}/s/{session['token']}"
        messages = [{"role": "user", "content": "list files"}]
        tools = [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}]
        body = {"model": "m", "messages": messages, "tools": tools}
        reply = _post(f"{session['base_url']}/v1/chat/completions", body)
        (call,) = reply["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "bash" and json.loads(call["function"]["arguments"]) == {"command": "ls"}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_bad_config_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[engine]\nkind = "scripted"\nreplies = ["x"]\n')
    done = subprocess.run([sys.executable, "-m", "polar_fast", "serve", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"polar_fast: {config}: unknown key 'engine.replies'"
