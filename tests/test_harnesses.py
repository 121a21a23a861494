"""Adapter contracts without running a CLI: registry, command shapes (token, model, proxy URL,
private HOME, approvals off), the bundle cache (second install is a no-op) and the forwarder."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from harness_run import write_home_files
from harness_servers import FakeModel, serve

from polar_fast import cli
from polar_fast.rollouts.harnesses import (
    HARNESSES,
    AgentCommand,
    ModelLimits,
    get_harness,
)
from polar_fast.rollouts.harnesses.bundles import MANIFEST, build_bundle, write_script

FORWARDER = Path(__file__).parents[1] / "polar_fast" / "rollouts" / "sandboxes" / "forwarder.py"
ARGS = dict(prompt="fix the bug", proxy_url="http://127.0.0.1:9/s/tok123", api_key="tok123",
            model="served-model", home="/h", bundle="/b", max_steps=7,
            limits=ModelLimits(context_tokens=32768, max_output_tokens=2048))


def test_registry_names_and_clear_error():
    assert set(HARNESSES) == {"mini-swe-agent", "codex", "claude-code", "qwen-code", "pi"}
    assert all(get_harness(n).name == n for n in HARNESSES)
    with pytest.raises(ValueError, match="unknown harness 'nope'.*claude-code.*codex"):
        get_harness("nope")


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_command_points_at_session_with_private_home(name):
    cmd = get_harness(name).command(**ARGS)
    assert isinstance(cmd, AgentCommand)
    assert cmd.argv[0].startswith("/b/bin/") and "fix the bug" in cmd.argv
    assert cmd.env["HOME"] == "/h" and cmd.env["PATH"].startswith("/b/bin:")
    text = json.dumps(cmd.env) + json.dumps(cmd.files) + json.dumps(cmd.argv)
    assert "tok123" in text and "served-model" in text and "http://127.0.0.1:9/s/tok123" in text
    assert all(not rel.startswith("/") and ".." not in rel for rel in cmd.files)


def test_codex_config_is_valid_toml_with_responses_provider():
    cmd = get_harness("codex").command(**ARGS | {"model": 'we"ird'})
    config = tomllib.loads(cmd.files[".codex/config.toml"])
    assert config["model"] == 'we"ird' and config["approval_policy"] == "never"
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == "http://127.0.0.1:9/s/tok123/v1" and provider["wire_api"] == "responses"
    assert cmd.env[provider["env_key"]] == "tok123"


def _limits(context: int, output: int) -> dict:
    return {"limits": ModelLimits(context_tokens=context, max_output_tokens=output)}


@pytest.mark.parametrize("context, output", [(32768, 2048), (48000, 1024), (8192, 1024), (200_000, 32000)])
def test_claude_code_compacts_where_a_native_window_of_the_context_would(context, output):
    """Claude Code's rule (its 2.1.332 binary): window W (CLAUDE_CODE_AUTO_COMPACT_WINDOW, floor
    100k), effective E = W - min(max output, 20k), threshold min(floor(E * pct / 100), E - 13k)."""
    env = get_harness("claude-code").command(**ARGS | _limits(context, output)).env
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == str(output)
    window = int(env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"])
    assert window == max(context, 100_000)
    effective = window - min(output, 20_000)
    pct = float(env.get("CLAUDE_AUTOCOMPACT_PCT_OVERRIDE", "100"))
    assert 0 < pct <= 100
    threshold = min(math.floor(effective * pct / 100), effective - 13_000)
    native = context - min(output, 20_000) - 13_000
    assert abs(threshold - max(native, 1)) <= 10, (threshold, native)


def test_codex_is_told_the_window_and_compacts_below_it():
    config = tomllib.loads(get_harness("codex").command(**ARGS).files[".codex/config.toml"])
    assert config["model_context_window"] == 32768
    assert 0 < config["model_auto_compact_token_limit"] <= 32768 - 2048


def test_pi_model_entry_carries_the_limits_and_compaction_fits_them():
    files = get_harness("pi").command(**ARGS).files
    (entry,) = json.loads(files[".pi/agent/models.json"])["providers"]["polar"]["models"]
    assert (entry["id"], entry["contextWindow"], entry["maxTokens"]) == ("served-model", 32768, 2048)
    compaction = json.loads(files[".pi/agent/settings.json"])["compaction"]
    assert compaction["enabled"] and compaction["reserveTokens"] >= 2048
    assert compaction["keepRecentTokens"] < 32768 - compaction["reserveTokens"]


def test_qwen_code_window_output_cap_and_threshold_leave_room_for_a_reply():
    settings = json.loads(get_harness("qwen-code").command(**ARGS).files[".qwen/settings.json"])
    generation = settings["model"]["generationConfig"]
    assert generation["contextWindowSize"] == 32768 and generation["samplingParams"]["max_tokens"] == 2048
    assert "sessionTokenLimit" not in settings["model"]  # that one ends the session instead
    fraction = settings["context"]["autoCompactThreshold"]
    assert 0 < fraction <= 0.85 and fraction * 32768 + 2048 <= 32768


def test_mini_swe_agent_step_limit_and_base_url():
    argv = get_harness("mini-swe-agent").command(**ARGS).argv
    assert "agent.step_limit=7" in argv and "model.model_kwargs.api_base=http://127.0.0.1:9/s/tok123/v1" in argv
    assert argv[argv.index("-m") + 1] == "openai/served-model"
    assert "model.model_kwargs.max_tokens=2048" in argv


def test_qwen_code_shell_waits_before_exit_but_its_children_do_not(tmp_path):
    """Qwen Code's shell tool runs `bash -c CMD` and settles on exit; the adapter's BASH_ENV file
    makes that bash wait before exiting (so Node reads the output first), keeping its status."""
    cmd = get_harness("qwen-code").command(**ARGS | {"home": str(tmp_path)})
    write_home_files(cmd, tmp_path)
    env = {"PATH": "/usr/bin:/bin", "BASH_ENV": cmd.env["BASH_ENV"]}
    script = 'printf out; bash -c \'printf " child=[%s]" "$BASH_ENV"\'; exit 3'
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=10)
    waited = time.monotonic() - start
    assert (done.returncode, done.stdout, done.stderr) == (3, "out child=[]", "")
    assert waited >= 0.1


def test_bundle_is_cached_and_built_atomically(tmp_path):
    builds = []

    def build(tmp: Path) -> None:
        builds.append(tmp)
        write_script(tmp / "bin" / "hello", "#!/bin/sh\necho hi\n")

    first = build_bundle(tmp_path, "demo", {"v": 1}, build, ["bin/hello"])
    again = build_bundle(tmp_path, "demo", {"v": 1}, build, ["bin/hello"])
    other = build_bundle(tmp_path, "demo", {"v": 2}, build, ["bin/hello"])
    assert first == again != other and len(builds) == 2
    assert (first / MANIFEST).exists() and not list(tmp_path.glob(".*.tmp"))


def test_failed_bundle_check_leaves_nothing(tmp_path):
    from polar_fast.rollouts.harnesses.bundles import BundleError

    def build(tmp: Path) -> None:
        write_script(tmp / "bin" / "broken", "#!/bin/sh\necho boom >&2; exit 3\n")

    with pytest.raises(BundleError, match="(?s)exited 3.*boom"):
        build_bundle(tmp_path, "bad", {}, build, ["bin/broken"])
    assert [p.name for p in tmp_path.iterdir()] == [".bad.lock"]


def test_cli_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["harnesses", "install", "nope"])
    assert "unknown harness 'nope'" in capsys.readouterr().err


def test_cli_asks_for_names_or_all(capsys):
    with pytest.raises(SystemExit):
        cli.main(["harnesses", "install"])
    assert "--all" in capsys.readouterr().err


@pytest.mark.anyio
async def test_forwarder_pipes_http_to_unix_socket(tmp_path):
    fake = FakeModel(answer="forwarded")
    async with serve(fake, unix_path=str(tmp_path / "s.sock")) as sock:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(FORWARDER), "--port", "0", "--socket", sock, stdout=asyncio.subprocess.PIPE)
        try:
            line = (await proc.stdout.readline()).decode()
            port = int(line.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({"model": "m", "messages": []}).encode()
            writer.write(b"POST /s/abc/v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            reply = await reader.read()
            writer.close()
        finally:
            proc.kill()
            await proc.wait()
    assert reply.startswith(b"HTTP/1.1 200") and b"forwarded" in reply
    assert fake.requests[0].path == "/s/abc/v1/chat/completions"
