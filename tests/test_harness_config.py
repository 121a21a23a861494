"""Harnesses declared in configuration (rollouts/harnesses/configured.py) and `harnesses check`
(preflight/harness_check.py).

- Pi and mini-swe-agent re-expressed as configuration (examples/harnesses/) give the adapters'
  exact command lines, env and HOME files, and the same bundle spec, at several model limits.
- A broken definition is refused at start with one line naming the key (CLI exit 2).
- A tiny Python agent that the test declares runs a rollout through the real proxy, the pools
  and a local sandbox, and is scored: `harnesses check` passes it. The same agent resending its
  reply re-cased fails the history line (with the first differing token, the change, the merge
  cost), and one that never calls the model fails the proxy line.
- OpenCode, declared in configuration only (examples/harnesses/opencode.toml), passes every line
  with the real CLI (slow: ~35 s).
"""

from __future__ import annotations

import asyncio
import json
import re
import tomllib
from pathlib import Path

import pytest

from polar_fast import cli
from polar_fast.config import load_config, parse_config
from polar_fast.errors import ConfigError
from polar_fast.preflight.harness_check import check_harness, format_report
from polar_fast.rollouts.harnesses import HARNESSES, ModelLimits, get_harness, run_harness
from polar_fast.rollouts.harnesses.configured import ConfiguredHarness, definition_from_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "harnesses"
ARGS = dict(prompt='Fix it: "quotes", {{ braces }} and $HOME', proxy_url="http://127.0.0.1:9/s/tok", api_key="tok",
            model="smollm2-135m-instruct", home="/tmp/h", bundle="/opt/polar/harness/x", max_steps=7)
LIMITS = [ModelLimits(context_tokens=c, max_output_tokens=o) for c, o in ((8192, 1024), (32768, 4096), (262144, 32768))]

AGENT = r'''
import json, os, subprocess, sys, urllib.request

url = os.environ["POLAR_URL"] + "/chat/completions"
tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": os.environ["TASK"]}]
for _ in range(int(os.environ["STEPS"])):
    body = json.dumps({"model": os.environ["MODEL"], "messages": messages, "tools": tools}).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["KEY"]}
    reply = json.load(urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=60))
    message = reply["choices"][0]["message"]
    if os.environ.get("RECASE"):  # sends back a history other than the one sampled
        message["content"] = (message.get("content") or "").upper()
    messages.append(message)
    if not message.get("tool_calls"):
        sys.exit(0)
    for call in message["tool_calls"]:
        command = json.loads(call["function"]["arguments"])["command"]
        done = subprocess.run(command, shell=True, capture_output=True, text=True)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": done.stdout + done.stderr})
sys.exit(1)
'''


def tiny_agent(**env: str) -> dict:
    return {"name": "tiny", "api": "chat", "argv": ["python3", "{{ home }}/agent.py"], "files": {"agent.py": AGENT},
            "env": {"POLAR_URL": "{{ proxy_url_v1 }}", "KEY": "{{ api_key }}", "MODEL": "{{ model }}",
                    "TASK": "{{ prompt }}", "STEPS": "{{ max_steps }}", **env}}


@pytest.mark.parametrize("limits", LIMITS, ids=lambda lim: f"{lim.context_tokens}")
@pytest.mark.parametrize("name", ["pi", "mini-swe-agent"])
def test_configured_builtin_matches_its_adapter(name, limits):
    configured = ConfiguredHarness(definition_from_file(EXAMPLES / f"{name}.toml", reserved=tuple(HARNESSES)))
    builtin = get_harness(name)
    assert configured.command(**ARGS, limits=limits) == builtin.command(**ARGS, limits=limits)
    assert configured.compaction_threshold(limits) == builtin.compaction_threshold(limits)
    assert configured.format_error_markers == tuple(getattr(builtin, "format_error_markers", ()))
    assert configured.end_command == getattr(builtin, "end_command", "")


def test_configured_builtin_bundles_hold_the_same_packages():
    pi = definition_from_file(EXAMPLES / "pi.toml").install
    mini = definition_from_file(EXAMPLES / "mini-swe-agent.toml").install
    from polar_fast.rollouts.harnesses import mini_swe_agent, pi as pi_adapter

    assert pi.npm == pi_adapter.PACKAGES and pi.node
    assert mini.pip == [mini_swe_agent.REQUIREMENT]


@pytest.mark.parametrize(("change", "message"), [
    ({"argv": []}, "key 'argv': missing"),
    ({"argv": ["{{ proxy }}"]}, "key 'argv[0]': unknown placeholder 'proxy'"),
    ({"env": {"A": "{{ prompt // 2 }}"}}, "key 'env.A': 'prompt' in 'prompt // 2': arithmetic takes only"),
    ({"json_files": {"a.json": {"x": ["{{ open('f') }}"]}}}, "key 'json_files.a.json.x[0]'"),
    ({"compaction_threshold": "context_window ** 2"}, "key 'compaction_threshold'"),
    ({"install": {"npm": {"opencode-ai": "latest"}, "bin": "opencode"}}, "key 'install.npm.opencode-ai': 'latest' is not a pinned"),
    ({"install": {"pip": ["aider-chat>=0.80"], "bin": "aider", "module": "aider"}}, "key 'install.pip[0]'"),
    ({"install": {"npm": {"a": "1.0.0"}}}, "key 'install.bin': missing"),
    ({"name": "pi"}, "key 'name': 'pi' is a built-in harness"),
    ({"api": "grpc"}, "key 'api': invalid enum value 'grpc'"),
    ({"argv_": ["x"]}, "unknown key 'argv_'"),
    ({"check": {"edit": "{{ file }}: {{ old }}"}}, "key 'check.edit': an edit needs {{ new }} too"),
    ({"check": {"edit": "{{ model }} {{ file }} {{ old }} {{ new }}"}}, "key 'check.edit': unknown placeholder 'model'"),
    ({"install": {"binary": "/usr/bin/env", "bin": "env"}}, "key 'install.sha256': the binary's sha256"),
    ({"install": {"binary": "crush", "sha256": "0" * 64}}, "key 'install.binary': 'crush' is not an absolute path"),
    ({"install": {"binary": "/usr/bin/env", "sha256": "0" * 64, "pip": ["a==1"]}}, "key 'install': one of npm"),
])
def test_a_broken_definition_is_refused_naming_the_key(change, message):
    cfg = parse_config({"harness": {"name": "tiny", "define": tiny_agent() | change}})
    with pytest.raises(ConfigError, match="^" + re.escape(f"harness.define: {message}")):
        run_harness(cfg.harness)


def test_a_binary_on_the_host_is_copied_into_the_bundle_only_with_its_pinned_hash(tmp_path):
    import hashlib

    from polar_fast.rollouts.harnesses import BundleError

    cli = tmp_path / "crush"
    cli.write_text("#!/bin/sh\necho crush 0.9.1\n")
    cli.chmod(0o755)
    pinned = hashlib.sha256(cli.read_bytes()).hexdigest()
    definition = tiny_agent() | {"install": {"binary": str(cli), "sha256": pinned}}
    harness = run_harness(parse_config({"harness": {"name": "tiny", "define": definition}}).harness)
    bundle = harness.install(tmp_path / "bundles")
    assert (bundle / "bin" / "crush").read_bytes() == cli.read_bytes()  # a copy: boxes cannot see the host path
    assert json.loads((bundle / ".polar-bundle.json").read_text())["binary_sha256"] == pinned
    cli.write_text("#!/bin/sh\necho another build\n")
    with pytest.raises(BundleError, match=f"has sha256 [0-9a-f]{{64}}, not the pinned {pinned}"):
        harness.install(tmp_path / "bundles-2")
    assert not (tmp_path / "bundles-2").exists() or not any((tmp_path / "bundles-2").iterdir())


def test_a_broken_definition_stops_the_cli_before_anything_starts(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text('name = "bad"\napi = "chat"\nargv = ["{{ bundel }}/bin/x"]\n')
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(f'[harness]\nname = "bad"\nfile = "{tmp_path / "bad.toml"}"\n'
                        f'[run]\noutput_dir = "{tmp_path / "run"}"\n')
    for argv in (["--config", str(run_toml)], ["harnesses", "check", str(tmp_path / "bad.toml")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "key 'argv[0]': unknown placeholder 'bundel'" in err, err
    assert not (tmp_path / "run").exists()  # nothing started
    with pytest.raises(ConfigError, match="unknown harness 'tiny'"):
        run_harness(load_config(None, ["harness.name=tiny"]).harness)


async def _check(tmp_path, definition: dict):
    path = tmp_path / "tiny.toml"
    await asyncio.to_thread(path.write_text, _toml(definition))
    cfg = load_config(None, [f"harness.bundle_dir={tmp_path / 'bundles'}"])
    report = await check_harness(cfg, str(path))
    return {i.name: i for i in report.items}, format_report(report)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_check_passes_a_configured_agent_whose_rollout_is_scored(tmp_path):
    items, text = await _check(tmp_path, tiny_agent())
    assert [i.status for i in items.values()] == ["pass", "n/a", "pass", "pass", "pass"], text
    assert "/v1/chat/completions (3 chat json requests)" in items["proxy"].evidence, text
    assert "reward 1.0" in items["end"].evidence, text  # the pools scored it: the fix passed the tests


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_check_fails_history_for_an_agent_that_rerenders(tmp_path):
    items, text = await _check(tmp_path, tiny_agent(RECASE="1"))
    assert items["history"].status == "fail", text
    evidence = items["history"].evidence
    assert "call 1 re-renders call 0: first differing token" in evidence, text
    assert "text changed (\"I'll look at the repository first.\" -> \"I'LL LOOK" in evidence, text
    assert "the merge breaks 2 times (in_completion 2" in evidence, text
    assert items["tool call"].status == items["end"].status == "pass", text  # it still works: only training suffers


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_check_fails_proxy_for_an_agent_that_never_calls(tmp_path):
    items, text = await _check(tmp_path, tiny_agent() | {"argv": ["python3", "-c", "print('no model here')"]})
    assert items["proxy"].status == "fail" and "no model call reached the proxy" in items["proxy"].evidence, text
    assert "no model here" in items["proxy"].evidence, text
    assert items["tool call"].status == items["history"].status == "fail", text


def _toml(value: dict) -> str:
    """Just enough TOML for a definition: strings, lists of strings, flat tables."""
    lines, tables = [], []
    for key, v in value.items():
        (tables if isinstance(v, dict) else lines).append((key, v))
    out = [f"{k} = {json.dumps(v)}" for k, v in lines]
    for k, table in tables:
        out += [f"[{k}]", *(f"{json.dumps(tk)} = {json.dumps(tv)}" for tk, tv in table.items())]
    text = "\n".join(out) + "\n"
    assert tomllib.loads(text) == value
    return text


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_opencode_from_configuration_alone_passes_the_check():
    # a CLI polar_fast ships no adapter for; scripts/test.sh installs its bundle (npm, cached)
    report = await check_harness(load_config(None), str(EXAMPLES / "opencode.toml"))
    assert report.ok, format_report(report)
    assert [i.status for i in report.items] == ["pass"] * 5, format_report(report)
