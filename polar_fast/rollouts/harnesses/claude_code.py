"""Anthropic Claude Code (`claude -p`), Anthropic Messages, streaming.

Pointed at the proxy by env: ANTHROPIC_BASE_URL (the client appends `/v1/messages`), the session
token as ANTHROPIC_API_KEY (sent as x-api-key), and every model slot (main, haiku/sonnet/opus
aliases, small-fast) set to the served model so no call asks for a model we do not serve.
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC turns off telemetry, error reporting and update checks.
Permissions: `--dangerously-skip-permissions` (the container is the sandbox); Claude Code refuses
it as root unless IS_SANDBOX=1, which says exactly that. `--max-turns` bounds agent turns.
The npm package ships a native binary, so the bundle has no Node.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_fast.rollouts.harnesses import AgentCommand
from polar_fast.rollouts.harnesses.bundles import install_npm_harness
from polar_fast.rollouts.harnesses.env import base_env

PACKAGES = {"@anthropic-ai/claude-code": "2.1.332"}


class ClaudeCode:
    name = "claude-code"

    def install(self, bundle_root: Path) -> Path:
        return install_npm_harness(bundle_root, self.name, PACKAGES, "claude", with_node=False)

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str,
                bundle: str, max_steps: int) -> AgentCommand:
        env = base_env(home=home, bundle=bundle) | {
            "ANTHROPIC_BASE_URL": proxy_url,
            "ANTHROPIC_API_KEY": api_key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "IS_SANDBOX": "1",
        }
        argv = [f"{bundle}/bin/claude", "-p", prompt, "--model", model,
                "--dangerously-skip-permissions", "--max-turns", str(max_steps)]
        # Onboarding state, so nothing waits for a first-run answer.
        state = json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})
        return AgentCommand(argv=argv, env=env, files={".claude.json": state})
