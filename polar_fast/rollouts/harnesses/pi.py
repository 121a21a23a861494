"""Pi coding agent (`pi -p`), OpenAI Chat Completions ("openai-completions"), streaming.

A provider "polar" in `~/.pi/agent/models.json` with the proxy's `/v1` base URL, the session
token as literal apiKey and the served model; `compat` keeps to plain `system` messages and no
`reasoning_effort`, which an open model's chat template understands. PI_OFFLINE turns off update
checks and install telemetry; `--no-session` keeps no session files. Pi has no turn limit flag.

Limits: the model entry's `contextWindow` and `maxTokens` (its per-call output cap). Pi compacts
when a call's context passes `contextWindow - compaction.reserveTokens` and keeps the last
`compaction.keepRecentTokens` verbatim; its defaults (16384 and 20000) are sized for 128k+
windows and would keep all of a 32k one, so reserve is one reply at the output cap plus a tenth
of the window (room for the tool output before the next call) and keep is a quarter of the window.
A prompt that still overflows gets the OpenAI-style "maximum context length is N tokens" error,
which Pi answers by compacting and retrying.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_fast.rollouts.harnesses import AgentCommand, ModelLimits
from polar_fast.rollouts.harnesses.bundles import install_npm_harness
from polar_fast.rollouts.harnesses.env import base_env

PACKAGES = {"@mariozechner/pi-coding-agent": "0.73.1"}
PROVIDER = "polar"
DEFAULT_KEEP_RECENT_TOKENS = 20_000  # Pi's own default


def compaction_threshold(limits: ModelLimits) -> int:
    """contextWindow - reserveTokens, with reserve = one reply at the cap + a tenth of the window."""
    return limits.context_tokens - (limits.max_output_tokens + limits.context_tokens // 10)


def compaction_settings(limits: ModelLimits) -> dict[str, int | bool]:
    window = limits.context_tokens
    return {"enabled": True, "reserveTokens": limits.max_output_tokens + window // 10,
            "keepRecentTokens": min(DEFAULT_KEEP_RECENT_TOKENS, window // 4)}


class Pi:
    name = "pi"

    def compaction_threshold(self, limits: ModelLimits) -> int:
        return compaction_threshold(limits)

    def install(self, bundle_root: Path) -> Path:
        return install_npm_harness(bundle_root, self.name, PACKAGES, "pi")

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str,
                bundle: str, max_steps: int, limits: ModelLimits) -> AgentCommand:
        models = {"providers": {PROVIDER: {
            "baseUrl": proxy_url + "/v1",
            "api": "openai-completions",
            "apiKey": api_key,
            "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
            "models": [{"id": model, "contextWindow": limits.context_tokens,
                        "maxTokens": limits.max_output_tokens}],
        }}}
        settings = {"enableInstallTelemetry": False, "compaction": compaction_settings(limits)}
        env = base_env(home=home, bundle=bundle) | {
            "PI_CODING_AGENT_DIR": f"{home}/.pi/agent",
            "PI_OFFLINE": "1",
            "PI_SKIP_VERSION_CHECK": "1",
            "PI_TELEMETRY": "0",
        }
        argv = [f"{bundle}/bin/pi", "-p", prompt, "--provider", PROVIDER, "--model", model, "--no-session"]
        files = {".pi/agent/models.json": json.dumps(models, indent=1),
                 ".pi/agent/settings.json": json.dumps(settings, indent=1)}
        return AgentCommand(argv=argv, env=env, files=files)
