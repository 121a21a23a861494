"""Anthropic Claude Code (`claude -p`), Anthropic Messages, streaming.

Pointed at the proxy by env: ANTHROPIC_BASE_URL (the client appends `/v1/messages`), the session
token as ANTHROPIC_API_KEY (sent as x-api-key), and every model slot (main, haiku/sonnet/opus
aliases, small-fast) set to the served model so no call asks for a model we do not serve.
CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC turns off telemetry, error reporting and update checks.
Permissions: `--dangerously-skip-permissions` (the container is the sandbox); Claude Code refuses
it as root unless IS_SANDBOX=1, which says exactly that. `--max-turns` bounds agent turns.
The npm package ships a native binary, so the bundle has no Node.

Limits: Claude Code does not know an unknown model's window (it assumes 1M tokens), so it is told.
CLAUDE_CODE_MAX_OUTPUT_TOKENS sets its per-call `max_tokens`. Auto-compaction fires at
`window - min(max output, 20k) - 13k` tokens of the last call's usage, where the window is
CLAUDE_CODE_AUTO_COMPACT_WINDOW; that knob has a 100k floor (a smaller value reads as 100k, read
in the 2.1.332 binary). For a smaller context the window stays at the floor and
CLAUDE_AUTOCOMPACT_PCT_OVERRIDE lowers the threshold to the one a native window of that size
would give (`min(floor(effective window * pct / 100), ...)`). If a prompt still overflows, the
proxy's Anthropic error reads `prompt is too long: N tokens > M maximum`, the text Claude Code
answers by compacting and retrying. CLAUDE_CODE_MAX_CONTEXT_TOKENS only applies with compaction
disabled (DISABLE_COMPACT), so it is not used.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_fast.rollouts.harnesses import AgentCommand, ModelLimits
from polar_fast.rollouts.harnesses.bundles import install_npm_harness
from polar_fast.rollouts.harnesses.env import base_env

PACKAGES = {"@anthropic-ai/claude-code": "2.1.332"}
AUTO_COMPACT_WINDOW_MIN = 100_000  # CLAUDE_CODE_AUTO_COMPACT_WINDOW below this reads as this
SUMMARY_RESERVE_MAX = 20_000  # the window keeps min(max output, this) free for the summary
AUTOCOMPACT_BUFFER = 13_000  # compaction fires this far below the effective window


def compaction_env(limits: ModelLimits) -> dict[str, str]:
    """The env that makes Claude Code compact where a native window of `context_tokens` would."""
    reserve = min(limits.max_output_tokens, SUMMARY_RESERVE_MAX)
    window = max(limits.context_tokens, AUTO_COMPACT_WINDOW_MIN)
    env = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(window),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(limits.max_output_tokens)}
    if window > limits.context_tokens:
        threshold = compaction_threshold(limits)
        pct = 100 * max(threshold, 1) / (window - reserve)
        env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] = f"{max(pct, 0.01):.2f}"
    return env


def compaction_threshold(limits: ModelLimits) -> int:
    """Where a native window of `context_tokens` compacts: window - min(out, 20k) - 13k."""
    return limits.context_tokens - min(limits.max_output_tokens, SUMMARY_RESERVE_MAX) - AUTOCOMPACT_BUFFER


class ClaudeCode:
    name = "claude-code"

    def compaction_threshold(self, limits: ModelLimits) -> int:
        return compaction_threshold(limits)

    def install(self, bundle_root: Path) -> Path:
        return install_npm_harness(bundle_root, self.name, PACKAGES, "claude", with_node=False)

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str,
                bundle: str, max_steps: int, limits: ModelLimits) -> AgentCommand:
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
        } | compaction_env(limits)
        argv = [f"{bundle}/bin/claude", "-p", prompt, "--model", model,
                "--dangerously-skip-permissions", "--max-turns", str(max_steps)]
        # Onboarding state, so nothing waits for a first-run answer.
        state = json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})
        return AgentCommand(argv=argv, env=env, files={".claude.json": state})
